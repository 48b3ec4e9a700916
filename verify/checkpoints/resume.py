"""The resume/reshard table: train, save, stop; load at another world size and stage; train on.

For each case (N1, s1) -> (N2, s2) in deterministic mode, with N1, N2 and M powers of two:
  1. an uninterrupted run: K = k + j steps at (N1, s1), never saving;
  2. k steps at (N1, s1), then engine.save(dir), and the ranks stop;
  3. fresh ranks at (N2, s2) build the model from another seed (so nothing survives by
     accident), engine.load(dir), and train j more steps from the loaded data position.
The row passes when (3) ends bit for bit where (1) did: every parameter's fp32 master and
optimizer states (gathered by name), the step counters, the loss scaler, and the loss of every
step after the resume. docs/design.md §2 says the bits of deterministic mode do not depend on N or
the stage for power-of-two N and M, so a checkpoint must not depend on them either. Each row
also consolidates the checkpoint and steps plain torch.optim from it ([Note: a resume row that
consolidates] at consolidated_step).

Launched plainly only: each world size runs on a local pool of gloo ranks (zero.ranks.launch).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine
from zero.loop import train_steps

from .. import features
from ..cells.cell import GROUPS, MODELS
from .consolidated import consolidated_step, microbatches

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
    features: tuple[str, ...] = ()
    """Options of every engine of the case (before, after, uninterrupted), as a Cell's
    (verify/features/): e.g. ("offload",) saves master and states from host memory and loads
    them back into it."""

    def __post_init__(self):
        object.__setattr__(self, "features", features.parse_features(self.features))

    def make_model(self):
        """The case's model, under its features (frozen parameters)."""
        return (features.builder(self.model, self.features) or MODELS[self.model][0])()

    @property
    def label(self) -> str:
        """The row's name: where it saves and loads, and what it trains."""
        return (
            f"N={self.n1} stage {self.s1} -> N={self.n2} stage {self.s2} {self.precision} "
            f"{self.optimizer} {self.model}{''.join(' ' + f for f in self.features)}"
        )

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
            **features.config_of(self.features),
        )


def build(case: ResumeCase, stage: int, *, seed: int = 0):
    """(model, engine) of a case at a stage; seed only sets the initial values."""
    model = case.make_model()
    if seed:
        from zero.workloads.models import init_parameters

        init_parameters(model, seed)
    return model, ZeroEngine(model, case.engine_config(stage, model.unit_names()))


def state_of(engine) -> dict:
    """Everything that must survive a resume, as NumPy bits (gathered on every rank)."""
    master, opt = engine.gather_state()
    out = {f"master/{k}": v.cpu().numpy() for k, v in master.items()}
    out.update({f"{x}/{k}": v.cpu().numpy() for k, d in opt.items() for x, v in d.items()})
    out["t"], out["data_step"] = engine.t, engine.data_step
    out["scaler"] = None if engine.scaler is None else asdict(engine.scaler)
    return out


def run_rank(
    rank, n, case: ResumeCase, stage, steps, save_to=None, load_from=None, first=False
) -> dict:
    """On every rank: build, optionally load, train `steps`, optionally save. Rank 0 returns
    the final state and the losses (with `first`, also the state after the first step, as
    "first"); the others return None."""
    torch.set_num_threads(1)
    model, eng = build(case, stage, seed=1 if load_from else 0)
    fmt = features.checkpoint_of(case.features)  # None: the native format
    if load_from is not None:
        eng.load(load_from) if fmt is None else fmt.load(eng, load_from)
    data, out = microbatches(case, model), {}
    # saving: a checkpoint after every step, the oldest pruned (KEEP_LAST); the resume loads
    # the newest, so pruning must have kept it. Another format: once, after the last step
    on_step = None if save_to is None else (lambda s, r: eng.save(save_to, keep_last=KEEP_LAST))
    if fmt is not None:
        on_step = None
    results = train_steps(
        eng, data, 1 if first else steps, start_step=eng.data_step, on_step=on_step
    )
    if first:
        out["first"] = state_of(eng)
        results += train_steps(eng, data, steps - 1, start_step=eng.data_step, on_step=on_step)
    if fmt is not None and save_to is not None:
        fmt.save(eng, save_to)
    out.update(state=state_of(eng), losses=[r.loss for r in results])
    return out if rank == 0 else None


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


def _rechecksum(m: dict) -> dict:
    """An edited manifest given a valid checksum again: a deliberate edit, not an accident."""
    from zero.checkpoint.format import _canonical

    body = {k: v for k, v in m.items() if k != "checksum"}
    return {**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()}


def _damages(step: Path) -> list[tuple[str, Callable[[Path], Path], str]]:
    """(what, damage(copy of the root) -> the file it damaged, what the error must name)."""
    shard = sorted(p.name for p in step.glob("u*-r*.bin"))[0]

    def flip(root):
        f = root / step.name / shard
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
        return f

    def truncate(root):
        f = root / step.name / shard
        f.write_bytes(f.read_bytes()[:-1])
        return f

    def symlink(root):
        f = root / step.name / shard
        f.unlink()
        f.symlink_to(root / step.name / "manifest.json")
        return f

    def fifo(root):
        f = root / step.name / shard
        f.unlink()
        os.mkfifo(f)
        return f

    def edit(key_path, value):
        def damage(root):
            f = root / step.name / "manifest.json"
            m = json.loads(f.read_text())
            target = m
            for k in key_path[:-1]:
                target = target[k]
            target[key_path[-1]] = value
            f.write_text(json.dumps(_rechecksum(m)))
            return f

        return damage

    def outside(root):
        (root / "latest").write_text("../elsewhere")
        return root / "latest"

    return [
        ("a byte flipped in a shard", flip, "checksum mismatch"),
        ("a shard one byte short", truncate, ""),
        ("a shard replaced by a symlink", symlink, ""),
        ("a shard replaced by a FIFO", fifo, ""),
        ("a parameter's shape edited, re-checksummed", edit(("params", 0, "shape"), [1, 1]), ""),
        ("a unit's states edited, re-checksummed", edit(("units", 0, "states"), ["master"]), ""),
        ("an unknown optimizer, re-checksummed", edit(("config", "optimizer"), "lamb"), ""),
        ("latest naming a path outside the root", outside, ""),
    ]


def check_refusals(directory: Path) -> str:
    """[Note: refused checkpoints] Each damage of _damages, made to a copy of the saved
    checkpoint, must make zero.checkpoint.verify raise a CheckpointError that names the damaged
    file (and never hang or read past the recorded sizes). '' or the first that was not."""
    from zero.checkpoint import CheckpointError, resolve
    from zero.checkpoint import verify as verify_checkpoint

    step = resolve(directory)
    for what, damage, says in _damages(step):
        with tempfile.TemporaryDirectory(prefix="zero-damaged-") as tmp:
            root = Path(tmp)
            shutil.copytree(step, root / step.name, symlinks=True)
            (root / "latest").write_text(step.name)
            bad = damage(root)
            try:
                verify_checkpoint(root)
            except CheckpointError as exc:
                if bad.name not in str(exc) or says not in str(exc):
                    return f"{what}: the error does not name {bad.name}: {exc}"
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is not a clear refusal
                return f"{what}: {type(exc).__name__} instead of a CheckpointError: {exc}"
            return f"{what}: accepted"
    return ""


def check_saved(case: ResumeCase, directory: Path, state: dict) -> str:
    """The saved checkpoint in this process, without an engine or a process group: pruned to
    KEEP_LAST step directories, every checksum verified (zero.checkpoint.verify), and its
    consolidation (written with consolidate_to, read back) loaded strictly into a fresh model
    and a torch.optim optimizer, holding the saving run's gathered state bit for bit. '' or
    the first difference. A row of another format (verify/features/: dcp) checks that format's
    consolidation as plain PyTorch reads it."""
    from zero.checkpoint import consolidate_to, resolve
    from zero.checkpoint import verify as verify_checkpoint

    fmt = features.checkpoint_of(case.features)
    if fmt is not None:
        return holds_state(case, fmt.consolidated(case, directory), state)
    steps = sorted(d.name for d in directory.iterdir() if d.name.startswith("step-"))
    if len(steps) != min(KEEP_LAST, case.steps_before) or resolve(directory).name != steps[-1]:
        return f"checkpoints kept: {steps}, latest {resolve(directory).name}"
    verify_checkpoint(directory)
    refused = check_refusals(directory)
    if refused:
        return f"damaged checkpoint: {refused}"
    c = torch.load(consolidate_to(directory, directory / "consolidated.pt"), weights_only=True)
    return holds_state(case, c, state)


def holds_state(case: ResumeCase, c: dict, state: dict) -> str:
    """'' when a consolidated dict ({model, optimizer, param_names, meta}), loaded strictly
    into a fresh model and torch.optim, holds the saving run's gathered state bit for bit."""
    from zero.optim.plain import TORCH_OPTIMIZERS

    model = case.make_model()
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


def run_case(case: ResumeCase, directory, *, timeout_s: float = 600, rank_fn=run_rank) -> dict:
    """One row of the table (see the module docstring); `directory` receives the checkpoint.
    rank_fn: run_rank, or a wrapper of it (verify/planted/suite.py plants a bug in the ranks)."""
    from zero.ranks.local import get_pool, spawn

    started = time.perf_counter()
    total = case.steps_before + case.steps_after
    p1 = get_pool(case.n1)
    whole = p1.run(rank_fn, case, case.s1, total, timeout_s=timeout_s)[0]
    saved = p1.run(rank_fn, case, case.s1, case.steps_before, str(directory), timeout_s=timeout_s)[
        0
    ]
    saved_as = check_saved(case, Path(directory), saved["state"])
    # fresh processes (zero.ranks.local.spawn, not a pool's workers), so that no module-level
    # state of the saving or the uninterrupted run can reach the resumed one
    resumed = spawn(
        rank_fn, case.n2, case, case.s2, case.steps_after, None, str(directory), True,
        timeout_s=timeout_s,
    )[0]  # fmt: skip
    state = compare_states(whole["state"], resumed["state"])
    if not state and whole["losses"][case.steps_before :] != resumed["losses"]:
        state = f"losses after the resume differ: {resumed['losses']} vs {whole['losses']}"
    plain = consolidated_step(case, directory, saved["state"], resumed["first"])
    consolidated = saved_as or plain["first_mismatch"]
    row = case_row(case, saved_as or state or plain["first_mismatch"], plain, started)
    # the named checks that failed (verify.features.RESUME_CHECKS): the resumed run against
    # the uninterrupted one, and the consolidated checkpoint against the saved state
    row["checks"] = [c for c, why in (("consolidation", consolidated), ("state", state)) if why]
    return row


def case_row(case: ResumeCase, first: str, plain: dict | None, started: float) -> dict:
    """A case's row: passed when `first` (the first mismatch, or the error it raised) is ''."""
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
        "consolidated": plain,
        "seconds": round(time.perf_counter() - started, 2),
        "config": asdict(case),
    }


def guarded_case(case: ResumeCase, directory, *, timeout_s: float) -> dict:
    """run_case, or the case's failing row (verify.checks.report.guarded) when it raises: a rank
    refusing to load, a pool that died. A rank's error breaks its pool; the next case gets a
    fresh one (zero.ranks.local.get_pool)."""
    from ..checks.report import guarded

    started = time.perf_counter()
    return guarded(
        case.label,
        lambda: run_case(case, directory, timeout_s=timeout_s),
        failed=lambda error: {
            **case_row(case, f"raised {error}", None, started),
            "checks": ["raised"],
        },
    )


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
    # a model with buffers (BatchNorm statistics, verify.cells.cell.NormMLP): saved from rank 0's,
    # loaded on every rank, consolidated beside the parameters
    buffers = [
        ResumeCase(n1=2, s1=1, n2=1, s2=2, precision="fp32", optimizer="sgd", model="mlp-bn",
                   micro_batches=m),
    ] if {1, 2} <= set(sizes) else []  # fmt: skip
    # the rows each feature adds (verify/features/), where the sizes hold the ones it needs
    buffers += [ResumeCase(**row, micro_batches=m) for row in features.resume_rows(set(sizes))]
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
    from zero.ranks.launch import under_torchrun

    if under_torchrun():
        return []
    with tempfile.TemporaryDirectory(prefix="zero-resume-") as tmp:
        base = Path(directory) if directory is not None else Path(tmp)
        return [
            guarded_case(c, base / f"case-{i:03d}", timeout_s=timeout_s)
            for i, c in enumerate(resume_cases(quick, world_sizes))
        ]


def run_table(*, world_sizes=(1, 2, 4), timeout_s: float = 600, quick: bool = True) -> list[dict]:
    """The table `python -m verify --resume` prints: resume_rows over these world sizes, then
    the model-parallel checkpoint rows (verify/mp/resume.py: a (2, 2) mesh loaded at (1, 2) and
    (2, 1)) when the sizes include 1, 2 and 4."""
    rows = resume_rows(quick=quick, world_sizes=world_sizes, timeout_s=timeout_s)
    if {1, 2, 4} <= set(world_sizes):
        from ..checks.report import guarded
        from ..mp.resume import failed_rows, mp_rows

        rows += guarded("mp resume", lambda: mp_rows(timeout_s=timeout_s), wrap=failed_rows)
    return rows
