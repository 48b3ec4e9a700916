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

from .core import PY, REPO, Ctx, Job, torchrun_argv

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

    def argv(self, out: Path, *extra: str, nproc=2, torchrun=False, steps=STEPS) -> list[str]:
        args = [*TRAIN, "--steps", str(steps), "--data", str(self.data), "--out", str(out), *extra]
        if torchrun:
            return torchrun_argv("zero.workloads.train", args, nproc)
        return [PY, "-m", "zero.workloads.train", "--nproc", str(nproc), *args]

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
