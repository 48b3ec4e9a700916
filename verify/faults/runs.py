"""Training runs for the fault cases: the undisturbed run, resuming, and the checkpoint audit.

Every run is `python -m zero.workloads.train` (or under torchrun) on the tiny GPT in deterministic
mode, so that a run that is interrupted and resumed from `latest` must end in exactly the bits of
the undisturbed run: `final_master_sha256` of OUT/train_log.json (zero/workloads/train.py) compares
them. `bytes_lost` audits a run's checkpoint root after a fault: every committed step directory (one
with a manifest) must still verify, and `latest` must name one of them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .core import PY, REPO, Case, Ctx, Job, Result, one_line_error, torchrun_argv

STEPS = 12
"""Steps of every training case: a checkpoint before the random point, and a few seconds of
work after it, so that the fault lands while the ranks still run."""

LONG_STEPS = 40
"""Steps of the launcher cases: the ranks must still have work left when the launcher goes,
so that ranks left running are seen (and not mistaken for ranks that had finished)."""

TRAIN = ["--model", "tiny", "--eval-every", "0", "--log-every", "1000", "--eval-batches", "1",
         "--ckpt-every", "1"]  # fmt: skip
"""The options every training case shares (a checkpoint at every step)."""


class Shared:
    """What cases share within one suite run: the corpus file and the undisturbed runs."""

    def __init__(self, root: Path, seed: int):
        self.root, self.seed = root, seed
        self.data = root / "corpus.txt"
        self.data.write_bytes(b"\n".join(p.read_bytes() for p in sorted(REPO.glob("zero/*.py"))))
        self._baseline: dict = {}

    def argv(self, out: Path, *extra: str, nproc=2, torchrun=False, steps=STEPS,
             module="zero.workloads.train") -> list[str]:  # fmt: skip
        """The training run's command line; `module` another entry point that takes the same
        options (verify/faults/hooks.py)."""
        args = [*TRAIN, "--steps", str(steps), "--data", str(self.data), "--out", str(out), *extra]
        if torchrun:
            return torchrun_argv(module, args, nproc)
        return [PY, "-m", module, "--nproc", str(nproc), *args]

    def baseline(self, ctx: Ctx, steps: int = STEPS) -> tuple[str, Path]:
        """(final master sha256, a finished run's OUT) of the undisturbed run, run once."""
        if steps not in self._baseline:
            out = self.root / f"baseline-{steps}"
            shutil.rmtree(out, ignore_errors=True)
            job = ctx.job(self.argv(out, steps=steps), tag=f"baseline-{steps}")
            code = job.wait(ctx)
            if code != 0:
                raise RuntimeError(f"the undisturbed run failed ({code}):\n{job.text()[-3000:]}")
            self._baseline[steps] = (final_sha(out), out)
        return self._baseline[steps]


def final_sha(out: Path) -> str | None:
    """The run's final master digest, None without a finished train_log.json."""
    try:
        return json.loads((out / "train_log.json").read_text())["result"]["final_master_sha256"]
    except (OSError, ValueError, KeyError):
        return None


def committed(root: Path) -> list[Path]:
    """Step directories under a checkpoint root that were committed (hold a manifest)."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and (d / "manifest.json").is_file())


def size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())


def bytes_lost(root: Path) -> tuple[int, str]:
    """Bytes of committed checkpoints that no longer verify (zero.checkpoint.verify, what
    `python -m zero.checkpoint verify` runs), and `latest` not naming a verifying one."""
    from zero.checkpoint import CheckpointError, resolve, verify

    lost, why = 0, []
    good = []
    for d in committed(root):
        try:
            verify(d)
            good.append(d)
        except CheckpointError as exc:
            lost += size(d)
            why.append(f"{d.name}: {exc}")
    if good:
        try:
            latest = resolve(root)
            if latest not in good:
                raise CheckpointError(f"latest names {latest.name}, which does not verify")
        except CheckpointError as exc:
            lost += size(good[-1])
            why.append(f"latest: {exc}")
    return lost, "; ".join(why)


def resume(ctx: Ctx, shared: Shared, out: Path, flag="--resume", *, tag="resume", **kw) -> Job:
    """`--resume` (or `--resume-if-present`) in place from OUT/ckpt/latest, to the same total
    steps."""
    return ctx.job(shared.argv(out, flag, **kw), tag=tag)


def rolled_back(ctx: Ctx) -> tuple[str, Path]:
    """(the undisturbed run's final sha256, a copy of its OUT in the case's directory with the
    last checkpoint removed and `latest` on the one before): a resume then has one step to run
    and must end in the undisturbed run's bits."""
    sha, base = ctx.shared.baseline(ctx)
    out = ctx.dir / "run"
    shutil.copytree(base, out, symlinks=True)
    root = out / "ckpt"
    shutil.rmtree(root / f"step-{STEPS:08d}")
    (root / "latest").write_text(f"step-{STEPS - 1:08d}\n")
    return sha, out


def tree(root: Path) -> dict:
    """size and mtime of every path under root: what 'nothing changed' compares."""
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


# -- faults of a run: a diverged loss, a timeout too short, a resume that changes the run ------


def _refusal(job, status: int, *needles: str) -> str | None:
    """None if `job` exited `status` with one error line holding every needle, else why not."""
    line = one_line_error(job.text())
    if job.proc.returncode != status or line is None:
        tail = job.text().strip().splitlines()[-1:] or [""]
        return f"exit {job.proc.returncode}, not {status} with one line: {tail[0][:160]}"
    missing = [n for n in needles if n not in line]
    return f"the line does not name {missing}: {line[:160]}" if missing else None


def diverged_case(ctx: Ctx) -> Result:
    """--lr 1e300, no checkpoint before the loss diverges: one line naming the step and the
    cause, exit 1, and nothing left behind (no history claiming a run, no OUT)."""
    out = ctx.dir / "run"
    job = ctx.job(ctx.shared.argv(out, "--lr", "1e300", "--ckpt-every", "0"), tag="lr")
    if job.wait(ctx) is None:
        return Result("hang", "the diverging run did not end")
    ctx.settle(job)
    if job.proc.returncode == 0:
        return Result("silent_wrong", "--lr 1e300 finished without an error")
    why = _refusal(job, 1, "step 2 of", "non-finite gradient", "--lr 1e+300")
    if why is not None:
        return Result("unclear", f"--lr 1e300: {why}")
    if out.exists():
        left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
        return Result("unclear", f"--lr 1e300: the failed run left {left}")
    line = one_line_error(job.text())
    return Result("refused", f"exit 1, one line ({line.split(': error: ')[1][:70]}...); "
                  "nothing left in --out")  # fmt: skip


def timeout_case(ctx: Ctx) -> Result:
    """--timeout 0.001: refused before any work (the first collective could not complete)."""
    out = ctx.dir / "run"
    job = ctx.job(ctx.shared.argv(out, "--timeout", "0.001"), tag="timeout")
    if job.wait(ctx) is None:
        return Result("hang", "the run with --timeout 0.001 did not end")
    ctx.settle(job)
    if job.proc.returncode == 0:
        return Result("silent_wrong", "--timeout 0.001 was accepted")
    why = _refusal(job, 2, "timeout_s=0.001", "at least 1 s")
    if why is not None:
        return Result("unclear", f"--timeout 0.001: {why}")
    if out.exists():
        return Result("unclear", "--timeout 0.001: refused, but after making --out")
    return Result("refused", "exit 2 before any work, one line naming timeout_s and the 1 s "
                  "minimum")  # fmt: skip


def changed_run_case(ctx: Ctx) -> Result:
    """--resume with another --seed: refused naming the field and both values, nothing
    changed; with --allow-changed-run it runs, and the log and the checkpoint record it."""
    from zero.checkpoint import read_manifest, resolve

    _, out = rolled_back(ctx)
    root = out / "ckpt"
    before = tree(root)
    refused = ctx.job(ctx.shared.argv(out, "--resume", "--seed", "1"), tag="seed1")
    if refused.wait(ctx) is None:
        return Result("hang", "--resume --seed 1 did not end")
    ctx.settle(refused)
    if refused.proc.returncode == 0:
        return Result("silent_wrong", "--resume --seed 1 trained on with the other seed")
    why = _refusal(refused, 2, "--seed: saved 0, now 1", "--allow-changed-run")
    if why is not None:
        return Result("unclear", f"--resume --seed 1: {why}")
    if tree(root) != before:
        return Result("unclear", "--resume --seed 1 was refused, but changed OUT/ckpt")
    argv = ctx.shared.argv(out, "--resume", "--seed", "1", "--allow-changed-run")
    allowed = ctx.job(argv, tag="allowed")
    if allowed.wait(ctx) is None:
        return Result("hang", "--resume --seed 1 --allow-changed-run did not end")
    ctx.settle(allowed)
    lost, why = bytes_lost(root)
    if allowed.proc.returncode != 0:
        return Result("unclear", f"--allow-changed-run failed: {allowed.text()[-300:]}", lost)
    want = [{"step": STEPS - 1, "field": "seed", "saved": 0, "now": 1}]
    logged = json.loads((out / "train_log.json").read_text())["config"].get("run_changes")
    saved = read_manifest(resolve(root))["extra"].get("run_changes")
    if logged != want or saved != want:
        return Result("unclear", f"the change is not recorded: log {logged}, checkpoint {saved}",
                      lost)  # fmt: skip
    detail = "refused, exit 2, one line naming '--seed: saved 0, now 1'; with --allow-changed-run "
    detail += "it ran, recorded in "
    detail += "train_log.json and the checkpoint" + (f"; {why}" if why else "")
    return Result("refused", detail, lost)


def cases(release: bool) -> list[Case]:
    """The faults of a run itself (listed with the checkpoint cases, verify/faults/storage.py)."""
    del release  # every one is quick: all in the fast subset
    return [
        Case("lr_diverges", "runs", "--lr 1e300: a non-finite gradient at step 2",
             "exit 1, one line naming the step and the cause; nothing left in --out",
             120, diverged_case, fast=True),
        Case("timeout_too_short", "runs", "--timeout 0.001, below the first collective",
             "exit 2 before any work, one line naming timeout_s and the minimum",
             60, timeout_case, fast=True),
        Case("changed_seed", "runs", "--resume with another --seed",
             "refused naming --seed and both values, nothing changed; --allow-changed-run runs "
             "and records it", 240, changed_run_case, fast=True),
    ]  # fmt: skip
