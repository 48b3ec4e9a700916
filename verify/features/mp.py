"""Model parallelism (zero/mp/): ZeRO in the data-parallel group of each tensor-parallel slice,
with P_a (activations partitioned over the MP group) and P_a+cpu. Verified in its own section,
`python -m verify --mp` (verify/mp/cells.py, against reference/mp.py), and its checkpoints in
the resume table's MP rows (verify/mp/resume.py): a Cell does not take it."""

from __future__ import annotations

from .record import Feature, Pair

FEATURE = Feature(
    name="mp",
    doc="model parallelism: ZeRO in the DP group of each tensor-parallel slice",
    config=lambda value: {},
    section="mp",
    pairs=(
        Pair("MP × P_a+cpu", "activation parts on the host, gathered over the MP group", "mp",
             lambda m: getattr(m, "p_a", None) == "cpu"),
        Pair("MP × offload_optimizer", "sliced masters in host memory", "mp",
             lambda m: "offload_optimizer" in getattr(m, "extra", ())),
        Pair("MP × contiguous_memory", "sliced gradients in arenas", "mp",
             lambda m: "contiguous_memory" in getattr(m, "extra", ())),
        Pair("MP × plain checkpoint", "a plain checkpoint cut into slices on load", "mp",
             lambda m: isinstance(m, str) and m.startswith("plain ")),
        Pair("MP checkpoint × plain engine", "slices joined on load", "mp",
             lambda m: isinstance(m, str) and m.endswith("-> plain 2")),
        Pair("MP checkpoint × N_m = 1", "slices joined, cut for one slice", "mp",
             lambda m: isinstance(m, str) and m.endswith("x1")),
    ),
)  # fmt: skip
