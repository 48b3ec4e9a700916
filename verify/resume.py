"""The resume/reshard table: train, save, stop; load at another world size and stage; train on.

For each case (N1, s1) -> (N2, s2) in deterministic mode, with N1, N2 and M powers of two:
  1. an uninterrupted run: K = k + j steps at (N1, s1), never saving;
  2. k steps at (N1, s1), then engine.save(dir), and the ranks stop;
  3. fresh ranks at (N2, s2) build the model from another seed (so nothing survives by
     accident), engine.load(dir), and train j more steps from the loaded data position.
The row passes when (3) ends bit for bit where (1) did: every parameter's fp32 master and
optimizer states (gathered by name), the step counters, the loss scaler, and the loss of every
step after the resume. docs/design.md §2 says the bits of deterministic mode do not depend on N or
the stage for power-of-two N and M, so a checkpoint must not depend on them either.

Launched plainly only: each world size runs on a local pool of gloo ranks (zero.launch).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine
from zero.train import train_steps

from .harness import GROUPS, MODELS

ACCUMULATE_M = 4  # M: micro-batches per step over all ranks; divisible by every N used here
KEEP_LAST = 1  # the saving run checkpoints every step and keeps this many


@dataclass(frozen=True, kw_only=True)
class ResumeCase:
    """One row: train steps_before at (n1, s1), save, load at (n2, s2), steps_after more."""

    n1: int
    s1: int
    n2: int
    s2: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    model: str = "mlp"
    steps_before: int = 2
    steps_after: int = 2
    micro_batches: int = ACCUMULATE_M
    offload: bool = False
    """Every engine of the case (before, after, uninterrupted) with offload_optimizer: the
    saved master and states come from host memory and load back into it."""

    def engine_config(self, stage: int, units) -> ZeroConfig:
        """The verify matrix's numerics (its groups, clipping at 1.0, chunks of 128) at a stage."""
        return ZeroConfig(
            stage=stage,
            precision=self.precision,
            deterministic=True,
            optimizer=self.optimizer,
            groups=GROUPS[self.optimizer],
            group_of=decay_matrices_only,
            micro_batches=self.micro_batches,
            clip_norm=1.0,
            units=tuple(units),
            chunk=128,
            offload_optimizer=self.offload,
        )


def build(case: ResumeCase, stage: int, *, seed: int = 0):
    """(model, engine) of a case at a stage; seed only sets the initial values."""
    make, _ = MODELS[case.model]
    model = make()
    if seed:
        from zero.models import init_parameters

        init_parameters(model, seed)
    return model, ZeroEngine(model, case.engine_config(stage, model.unit_names()))


def microbatches(case: ResumeCase, model):
    """microbatch(step, j): a function of (seed 0, step, j) only, as train_steps wants."""
    _, data = MODELS[case.model]

    def microbatch(step: int, j: int):
        return data(model.cfg, seed=0, data_step=step, count=j + 1, batch_size=4)[j]

    return microbatch


def state_of(engine) -> dict:
    """Everything that must survive a resume, as NumPy bits (gathered on every rank)."""
    master, opt = engine.gather_state()
    out = {f"master/{k}": v.cpu().numpy() for k, v in master.items()}
    out.update({f"{x}/{k}": v.cpu().numpy() for k, d in opt.items() for x, v in d.items()})
    out["t"], out["data_step"] = engine.t, engine.data_step
    out["scaler"] = None if engine.scaler is None else asdict(engine.scaler)
    return out


def run_rank(rank, n, case: ResumeCase, stage, steps, save_to=None, load_from=None) -> dict:
    """On every rank: build, optionally load, train `steps`, optionally save. Rank 0 returns
    the final state and the losses; the others return None."""
    torch.set_num_threads(1)
    model, eng = build(case, stage, seed=1 if load_from else 0)
    if load_from is not None:
        eng.load(load_from)
    # saving: a checkpoint after every step, the oldest pruned (KEEP_LAST); the resume loads
    # the newest, so pruning must have kept it
    on_step = None if save_to is None else (lambda s, r: eng.save(save_to, keep_last=KEEP_LAST))
    results = train_steps(
        eng, microbatches(case, model), steps, start_step=eng.data_step, on_step=on_step
    )
    state = state_of(eng)
    return {"state": state, "losses": [r.loss for r in results]} if rank == 0 else None


def compare_states(a: dict, b: dict) -> str:
    """The first difference between two state_of() results ('' if bitwise equal)."""
    if sorted(a) != sorted(b):
        return f"different entries: {sorted(set(a) ^ set(b))[:3]}"
    for key in sorted(a):
        x, y = a[key], b[key]
        if isinstance(x, np.ndarray):
            if x.shape != y.shape or not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
                return f"{key}: bits differ"
        elif x != y:
            return f"{key}: {x!r} != {y!r}"
    return ""


def check_saved(case: ResumeCase, directory: Path, state: dict) -> str:
    """The saved checkpoint in this process, without an engine or a process group: pruned to
    KEEP_LAST step directories, every checksum verified (zero.checkpoint.verify), and its
    consolidation (written with consolidate_to, read back) loaded strictly into a fresh model
    and a torch.optim optimizer, holding the saving run's gathered state bit for bit. '' or
    the first difference."""
    from zero.checkpoint import consolidate_to, resolve
    from zero.checkpoint import verify as verify_checkpoint
    from zero.optim import TORCH_OPTIMIZERS

    steps = sorted(d.name for d in directory.iterdir() if d.name.startswith("step-"))
    if len(steps) != min(KEEP_LAST, case.steps_before) or resolve(directory).name != steps[-1]:
        return f"checkpoints kept: {steps}, latest {resolve(directory).name}"
    verify_checkpoint(directory)
    c = torch.load(consolidate_to(directory, directory / "consolidated.pt"), weights_only=True)
    model, _ = MODELS[case.model]
    model = model()
    model.load_state_dict(c["model"], strict=True)
    params = dict(model.named_parameters())
    kind = getattr(torch.optim, TORCH_OPTIMIZERS[case.optimizer])
    opt = kind([{"params": [params[n] for n in names]} for names in c["param_names"]])
    opt.load_state_dict(c["optimizer"])  # strict: the groups' sizes and keys must match
    got = {}
    for n in (n for names in c["param_names"] for n in names):
        got[f"master/{n}"] = params[n].detach().numpy()
        got.update({f"{k}/{n}": v.numpy() for k, v in opt.state[params[n]].items() if k != "step"})
    want = {k: v for k, v in state.items() if "/" in k}
    if sorted(want) != sorted(got):
        return f"consolidated entries differ: {sorted(set(want) ^ set(got))[:3]}"
    meta = (c["meta"]["t"], c["meta"]["data_step"])
    if meta != (state["t"], state["data_step"]):
        return f"consolidated (t, data_step) {meta}, saved {(state['t'], state['data_step'])}"
    return compare_states(want, got)


def run_case(case: ResumeCase, directory, *, timeout_s: float = 600) -> dict:
    """One row of the table (see the module docstring); `directory` receives the checkpoint."""
    from zero.launch import get_pool, spawn

    started = time.perf_counter()
    total = case.steps_before + case.steps_after
    p1 = get_pool(case.n1)
    whole = p1.run(run_rank, case, case.s1, total, timeout_s=timeout_s)[0]
    saved = p1.run(run_rank, case, case.s1, case.steps_before, str(directory), timeout_s=timeout_s)[
        0
    ]
    first = check_saved(case, Path(directory), saved["state"])
    # fresh processes (zero.launch.spawn, not a pool's workers), so that no module-level
    # state of the saving or the uninterrupted run can reach the resumed one
    resumed = spawn(
        run_rank, case.n2, case, case.s2, case.steps_after, None, str(directory),
        timeout_s=timeout_s,
    )[0]  # fmt: skip
    first = first or compare_states(whole["state"], resumed["state"])
    if not first and whole["losses"][case.steps_before :] != resumed["losses"]:
        first = f"losses after the resume differ: {resumed['losses']} vs {whole['losses']}"
    return {
        "from_world_size": case.n1,
        "from_stage": case.s1,
        "to_world_size": case.n2,
        "to_stage": case.s2,
        "precision": case.precision,
        "optimizer": case.optimizer,
        "model": case.model,
        "steps_before": case.steps_before,
        "steps_after": case.steps_after,
        "micro_batches": case.micro_batches,
        "mode": "deterministic",
        "bitwise": not first,
        "passed": not first,
        "first_mismatch": first,
        "seconds": round(time.perf_counter() - started, 2),
        "config": asdict(case),
    }


def resume_cases(quick: bool = True, world_sizes=(1, 2, 4)) -> list[ResumeCase]:
    """The cases over the power-of-two sizes among world_sizes (other N have their own trees,
    docs/design.md §2, so no bitwise resume across N is promised for them); M = max(4, largest N).

    quick: one case per ordered pair (N1, N2), stages and (precision, optimizer) rotating so
    that with three sizes every stage is left and entered and all nine (precision, optimizer)
    pairs appear once, and one case on a model with buffers. Otherwise every (N1, s1) ->
    (N2, s2) with (N1, s1) != (N2, s2), AdamW and bf16 on the MLP, plus the quick cases on the
    GPT (tied embedding and head), and the buffers case."""
    sizes = sorted({n for n in world_sizes if n >= 1 and n & (n - 1) == 0})
    m = max([ACCUMULATE_M, *sizes])
    kinds = [(p, o) for p in ("fp32", "bf16", "fp16") for o in ("sgd", "adam", "adamw")]
    quick_cases = []
    for i, (n1, n2) in enumerate((a, b) for a in sizes for b in sizes):
        s1, s2 = i % 4, (3 * i + 1) % 4
        if (n1, s1) == (n2, s2):
            s2 = (s2 + 1) % 4
        p, o = kinds[i % len(kinds)]
        quick_cases.append(
            ResumeCase(n1=n1, s1=s1, n2=n2, s2=s2, precision=p, optimizer=o, micro_batches=m)
        )
    # a model with buffers (BatchNorm statistics, verify.harness.NormMLP): saved from rank 0's,
    # loaded on every rank, consolidated beside the parameters
    buffers = [
        ResumeCase(n1=2, s1=1, n2=1, s2=2, precision="fp32", optimizer="sgd", model="mlp-bn",
                   micro_batches=m)
    ] if {1, 2} <= set(sizes) else []  # fmt: skip
    if quick:
        return quick_cases + buffers
    grid = [
        ResumeCase(n1=n1, s1=s1, n2=n2, s2=s2, micro_batches=m)
        for n1 in sizes
        for s1 in range(4)
        for n2 in sizes
        for s2 in range(4)
        if (n1, s1) != (n2, s2)
    ]
    gpt = [ResumeCase(**{**asdict(c), "model": "gpt"}) for c in quick_cases]
    return quick_cases + grid + gpt + buffers


def resume_rows(
    *, quick: bool = True, world_sizes=(1, 2, 4), directory=None, timeout_s: float = 600
) -> list[dict]:
    """Every case of resume_cases(quick, world_sizes) as a row dict (see run_case). Checkpoints
    go to fresh subdirectories of `directory` (a temporary directory, removed afterwards, when
    None). Launched plainly only: under torchrun the world size is fixed, so this returns []."""
    from zero.launch import under_torchrun

    if under_torchrun():
        return []
    with tempfile.TemporaryDirectory(prefix="zero-resume-") as tmp:
        base = Path(directory) if directory is not None else Path(tmp)
        return [
            run_case(c, base / f"case-{i:03d}", timeout_s=timeout_s)
            for i, c in enumerate(resume_cases(quick, world_sizes))
        ]


def run_table(*, world_sizes=(1, 2, 4), timeout_s: float = 600, quick: bool = True) -> list[dict]:
    """The table `python -m verify --resume` prints: resume_rows over these world sizes."""
    return resume_rows(quick=quick, world_sizes=world_sizes, timeout_s=timeout_s)
