"""What one simulated rank (d, m) of an N_d × N_m mesh keeps, estimated from the model alone.

``estimate(setup, name, L)`` gives rank (0, 0)'s bytes by category for configuration `name`
(measure.budget's C1-C5) on a GPT of L blocks: the model states of its TPGPT slice at
N = N_d (zero.common.memory.model_state_breakdown at the padded count of reference/layout.py, as the
engine lays units out) and its activation checkpoints (zero.common.memory.checkpoint_bytes), on the
device or, with offload (C5's P_a+cpu), in host memory. Nothing is built: the slice's shapes
come from a meta TPGPT. The measured side is measure.budget.probe (tests/distributed/
test_zero_r_mp.py checks the two agree category by category).

Legend: N_d, N_m the DP and MP degrees, L blocks, X = b·s·h one block's checkpoint.
"""

from __future__ import annotations

from zero.common.memory import checkpoint_bytes, model_state_breakdown

from .budget import Setup, configurations


def slice_units(setup: Setup, layers: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The (name, shape) lists of rank m = 0's TPGPT slice, root first, as the engine's units
    (zero/build.py: the tied head in the root, once)."""
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, MPContext
    from zero.workloads.models import GPTConfig

    cfg = GPTConfig(
        vocab_size=setup.vocab_size,
        block_size=max(setup.seq, 16),
        n_layer=layers,
        n_head=setup.heads,
        n_embd=setup.hidden,
    )
    ctx = MPContext(group=None, size=setup.mp, rank=0, counter=CommCounter())
    model = TPGPT(cfg, ctx)  # meta: shapes only
    units = {"": []} | {f"transformer.h.{i}": [] for i in range(layers)}
    for name, p in model.named_parameters():
        unit = ".".join(name.split(".")[:3]) if name.startswith("transformer.h.") else ""
        units[unit].append((name, tuple(p.shape)))
    return list(units.values())


def estimate(setup: Setup, name: str, layers: int) -> dict[str, float]:
    """Rank (0, 0)'s bytes by category, from the model alone: the slice's model states at
    N = N_d (zero.common.memory, padded as reference/layout.py lays units out) and its checkpoints
    (zero.common.memory.checkpoint_bytes), on the device or, for C5, in host memory."""
    from reference.layout import unit_layout

    conf = next(c for c in configurations(setup.mp) if c.name == name)
    padded = sum(
        unit_layout(u, chunk=setup.chunk).padded_numel(setup.world_size)
        for u in slice_units(setup, layers)
    )
    states = model_state_breakdown(num_params=padded, world_size=setup.world_size, stage=conf.stage)
    ckpt = checkpoint_bytes(
        layers=layers,
        tokens=setup.batch * setup.seq,
        hidden=setup.hidden,
        mp=setup.mp,
        partitioned=conf.partition_activations and setup.mp > 1,
    )
    host = conf.offload_activations
    return {
        **{k: v for k, v in states.to_dict().items() if k != "total"},
        "model_states": states.total,
        "checkpoints_device": 0.0 if host else ckpt,
        "checkpoints_host": ckpt if host else 0.0,
        "padded_params": padded,
    }


def measure_together(setup: Setup, names, layers: int, *, timeout_s: float = 600) -> dict:
    """Each configuration in `names` built and stepped once on rank (0, 0), all in one fresh
    process (one interpreter start instead of one per configuration): per name, the engine's
    memory_report, the host checkpoint bytes it counted, the MP traffic by phase and the padded
    count. No peaks: after the first configuration the process is not at its baseline (use
    measure.budget.probe, one process each, for those)."""
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "measure.mp_rank", json.dumps(setup.to_dict()), str(layers)]
    done = subprocess.run(
        [*argv, *names], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"measure.mp_rank failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main(argv: list[str]) -> None:
    """python -m measure.mp_rank SETUP_JSON LAYERS NAME...: measure_together's child."""
    import json

    from .fake_rank import simulate_rank

    setup, layers = Setup(**json.loads(argv[0])), int(argv[1])
    confs = {c.name: c for c in configurations(setup.mp)}
    out = {}
    for name in argv[2:]:
        conf = confs[name]
        r = simulate_rank(
            params=0,
            world_size=setup.world_size,
            rank=0,
            stage=conf.stage,
            steps=1,
            seq=setup.seq,
            batch=setup.batch,
            vocab_size=setup.vocab_size,
            mp=setup.mp,
            shape={"n_layer": layers, "n_embd": setup.hidden, "n_head": setup.heads},
            options=conf.options(setup),
        )
        keys = ("engine_report", "activation_host_bytes", "mp_traffic", "padded_params")
        out[name] = {k: r[k] for k in keys}
    print(json.dumps(out))


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
