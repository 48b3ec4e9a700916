"""Two minutes of ZeRO: the four stages give the same bits, hold less, and move what the paper says.

    python -m verify.demo              # 2 local gloo ranks, 3 steps per stage, about 10 s

One small GPT (verify.cells.cell.MODELS["gpt"]) trains at stages 0, 1, 2 and 3 on the same 2 ranks,
in
deterministic mode and in the paper's configuration (bf16 working copy, gradients reduced in bf16,
fp32 master, Adam; M = N). One row per stage:
- loss: the global loss of the last step;
- same bits: whether the final state's digest (verify.checks.harness.state_digest) equals stage 0's;
- params / grads / master / optimizer: resident model-state bytes on one rank
  (engine.memory_report()), their total over stage 0's beside the paper's (docs/paper.md §1.1);
- traffic: model-state elements sent per step, summed over ranks, in units of Ψ·(N-1)/N, beside
  the paper's 2Ψ / 2Ψ / 2Ψ / 3Ψ (docs/paper.md §1.4; the rule is docs/design.md §2). Stage 3
  shows a little under 3: the root unit stays gathered through backward
  (paper_figures/comm_volume.py).

Legend: Ψ = parameters, N = ranks, M = micro-batches per step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

CATEGORIES = ("params", "grads", "master", "optimizer")
PAPER_TRAFFIC = {0: 2, 1: 2, 2: 2, 3: 3}
"""The paper's per-step volume in units of Ψ (docs/paper.md §1.4)."""


@dataclass(frozen=True)
class Row:
    """One stage's outcome, as the table prints it."""

    stage: int
    loss: float
    digest: str
    memory: dict[str, int]  # rank 0's memory_report() categories, bytes
    elements: int  # model-state elements sent in the last step, summed over ranks, no padding
    num_params: int  # Ψ
    padded: int  # Σ padded unit sizes (what the analytic model needs as num_params + padding)
    world_size: int

    @property
    def traffic(self) -> float:
        """Elements per step in units of Ψ·(N-1)/N."""
        return self.elements / (self.num_params * (self.world_size - 1))


def config(stage: int, world_size: int, units: tuple[str, ...]):
    """The paper's configuration (docs/design.md §3), deterministic, M = N."""
    from zero.config import ZeroConfig

    paper = dict(precision="bf16", reduce_dtype="bf16", optimizer="adam", deterministic=True)
    return ZeroConfig(stage=stage, micro_batches=world_size, chunk=128, units=units, **paper)


def _rank(rank: int, world_size: int, steps: int) -> list[dict]:
    """Every stage in turn on this rank; what each ended with."""
    from verify.cells.cell import MODELS
    from verify.checks.harness import state_digest
    from zero.engine import ZeroEngine
    from zero.loop import train_steps

    build, data = MODELS["gpt"]
    out = []
    for stage in range(4):
        model = build()
        engine = ZeroEngine(model, config(stage, world_size, tuple(model.unit_names())))

        def microbatch(step, j, cfg=model.cfg):  # a function of (seed, step, j) only
            return data(cfg, seed=0, data_step=step, count=j + 1, batch_size=4)[j]

        results = train_steps(engine, microbatch, steps)
        last = engine.counter.step - 1
        sent, padding = engine.counter.volume(last)
        out.append(
            {
                "loss": results[-1].loss,
                "digest": state_digest(engine, results[-1]),
                "memory": engine.memory_report(),
                "elements": sent - padding,
                "num_params": sum(u.numel for u in engine.units),
                "padded": sum(u.part.padded_numel for u in engine.units),
            }
        )
    return out


def run(*, world_size: int = 2, steps: int = 3) -> list[Row]:
    """Train stages 0-3 on `world_size` local gloo ranks; one Row per stage."""
    from zero.ranks.local import spawn

    ranks = spawn(_rank, world_size, steps, timeout_s=300)
    rows = []
    for stage in range(4):
        per = [r[stage] for r in ranks]
        assert len({p["digest"] for p in per}) == 1, "ranks disagree on the final state"
        first = per[0]
        memory = {k: first["memory"][k] for k in CATEGORIES}
        elements = sum(p["elements"] for p in per)
        keep = {k: first[k] for k in ("loss", "digest", "num_params", "padded")}
        rows.append(
            Row(stage=stage, memory=memory, elements=elements, world_size=world_size, **keep)
        )
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    n = rows[0].world_size
    head = (
        f"ZeRO stages 0-3 on {n} gloo ranks, Ψ = {rows[0].num_params:,} parameters, "
        "bf16 + fp32 master, Adam, deterministic\n\n"
        "| stage | final loss | same bits as stage 0 | params B | grads B | master B "
        "| optimizer B | total B/rank | ×stage 0 | paper | traffic ×Ψ(N-1)/N | paper |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    from zero.common.memory import bytes_per_param

    total0 = sum(rows[0].memory.values())
    lines = [head]
    for r in rows:
        total = sum(r.memory.values())
        mem = " | ".join(f"{r.memory[k]:,}" for k in CATEGORIES)
        paper_mem = bytes_per_param(n, r.stage) / 16
        same = "yes" if r.digest == rows[0].digest else "NO"
        lines.append(
            f"| {r.stage} | {r.loss:.6f} | {same} | {mem} | {total:,} | {total / total0:.3f} "
            f"| {paper_mem:.3f} | {r.traffic:.3f} | {PAPER_TRAFFIC[r.stage]}Ψ |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verify.demo", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--world-size", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per stage")
    args = parser.parse_args(argv)
    for name in ("world_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"{name}={getattr(args, name)}: must be an integer >= 1")
    rows = run(world_size=args.world_size, steps=args.steps)
    print(table(rows))
    same = all(r.digest == rows[0].digest for r in rows)
    print("\nEvery stage ends in the same bits." if same else "\nThe stages DISAGREE.")
    return 0 if same else 1


if __name__ == "__main__":
    from zero.common import cli

    cli.run(main, "python -m verify.demo")
