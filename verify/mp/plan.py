"""The model-parallel section's plan: the GPT and the step every cell trains (CFG, BATCH, M,
CHUNK, CLIP, SEED), what a cell is (MPCell: the mesh, stage, precision, P_a, the options composed
with MP, a planted engine bug) and which cells the quick and complete presets run. Data only,
light to import; verify/mp/cells.py runs the cells.
"""

from __future__ import annotations

from dataclasses import dataclass

CFG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
"""The GPT of the cells at N_m <= 2; at N_m = 4 the same with 4 heads (heads are split whole)."""
BATCH, M, CHUNK, CLIP = 2, 4, 128, 0.05
"""The model and step: CLIP is far below the first steps' norms (about 1.2), so every step
clips (each row records it)."""
SEED = 3
"""The initial values: GPT(config, seed=SEED)'s, cut per MP index."""
EXTRAS = ("offload_optimizer", "contiguous_memory")
"""Options that compose with MP: ZeRO-Offload's host optimizer, ZeRO-R's M_D arenas."""
PLANTS = ("double", "p_a_order", "tp_scale")
"""Engine bugs a cell must catch: the replicated parameters counted in the norm on every MP
rank; P_a's gather returning the MP ranks' parts in the wrong order; every row-parallel output
scaled by 1.0001 on every MP rank (a tensor-parallel layer wrong in a self-consistent way, which
a reference computed through zero/mp would share)."""


@dataclass(frozen=True, kw_only=True)
class MPCell:
    dp: int
    mp: int
    stage: int
    precision: str = "fp32"
    p_a: str = "off"  # "off", "on" (P_a), "cpu" (P_a+cpu)
    steps: int = 2
    plant: str | None = None
    from_gpt: bool = False  # the slice cut from the whole GPT(seed) (TPGPT.from_gpt), not built
    extra: tuple[str, ...] = ()  # ZeroConfig flags set True: EXTRAS

    @property
    def world_size(self) -> int:
        return self.dp * self.mp

    @property
    def label(self) -> str:
        p_a = {"off": "", "on": " P_a", "cpu": " P_a+cpu"}[self.p_a]
        plant = f" plant={self.plant}" if self.plant else ""
        how = " from_gpt" if self.from_gpt else ""
        how += "".join(f" {x}" for x in self.extra)
        return f"N_d={self.dp} N_m={self.mp} stage {self.stage} {self.precision}{p_a}{how}{plant}"

    def options(self) -> dict:
        extra = dict.fromkeys(self.extra, True)
        if self.p_a == "off":
            return extra
        on = dict(activation_checkpointing=True, partition_activations=True, **extra)
        return {**on, "offload_activations": True} if self.p_a == "cpu" else on


def quick_cells() -> list[MPCell]:
    """Stages 0 and 3 on each mesh (1 and 2 once each), fp32 (the stage-1 cell cuts its slice
    from the whole GPT: the same digests as the built ones); two bf16 cells and two fp16 cells
    (loss scaling: the first step overflows and is skipped on every rank); P_a and P_a+cpu at
    stage 3 on (2, 2), each bitwise equal to the same cell without P_a; optimizer offload (fp16,
    stage 1) and P_a in the M_D arena (bf16, stage 3) on (2, 2)."""
    plan = [(1, 2, 0), (1, 2, 1), (1, 2, 3), (2, 2, 0), (2, 2, 3), (2, 1, 0), (2, 1, 2), (2, 1, 3)]
    cells = [MPCell(dp=d, mp=m, stage=s, from_gpt=(d, m, s) == (1, 2, 1)) for d, m, s in plan]
    cells += [
        MPCell(dp=2, mp=2, stage=2, precision="bf16"),
        MPCell(dp=1, mp=2, stage=3, precision="bf16"),
        MPCell(dp=1, mp=2, stage=0, precision="fp16"),
        MPCell(dp=2, mp=2, stage=3, precision="fp16"),
    ]
    cells += [MPCell(dp=2, mp=2, stage=3, p_a=p) for p in ("on", "cpu")]
    return cells + [
        MPCell(dp=2, mp=2, stage=1, precision="fp16", extra=("offload_optimizer",)),
        MPCell(dp=2, mp=2, stage=3, precision="bf16", p_a="on", extra=("contiguous_memory",)),
    ]


def complete_cells() -> list[MPCell]:
    """Every stage × fp32/bf16/fp16 × (N_d, N_m) ∈ {(1,2), (2,2), (2,1), (1,4)} × P_a off/on
    (at N_m = 1, P_a keeps the whole checkpoint: the plain activation checkpointing); then each
    of EXTRAS with P_a, bf16, every stage on (2, 2) and (1, 4)."""
    plain = [
        MPCell(dp=d, mp=m, stage=s, precision=p, p_a=a)
        for d, m in ((1, 2), (2, 2), (2, 1), (1, 4))
        for s in range(4)
        for p in ("fp32", "bf16", "fp16")
        for a in ("off", "on")
    ]
    return plain + [
        MPCell(dp=d, mp=m, stage=s, precision="bf16", p_a="on", extra=(x,))
        for d, m in ((2, 2), (1, 4))
        for s in range(4)
        for x in EXTRAS
    ]
