"""The command line of `python -m zero.workloads.train`: TrainConfig (every field an option of
the same name, through zero/common/cli.py), the model sizes it offers (build_model: this rank's),
and `parse`; what a run checks before any work (`claim`: OUT locked and tidied, the checkpoint
--resume would load), and the run's identity a resume must keep (RUN_IDENTITY, check_identity).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from reference.optim import Hyper

from .. import checkpoint
from ..checkpoint import lock, read_manifest
from ..checkpoint.leftovers import remove_leftovers
from ..common import cli
from ..config import STAGES, TORCH_DTYPES, ZeroConfig, decay_matrices_only
from ..optim.plain import TORCH_OPTIMIZERS
from ..ranks.launch import check_timeout
from .data import VOCAB_SIZE
from .history import FILE as HISTORY_FILE
from .models import GPT, GPTConfig

# ---------------------------------------------------------------------------------------------
# The CLI's configuration

MODELS = {
    # ~0.11M parameters: seconds, for tests
    "tiny": (GPTConfig(vocab_size=VOCAB_SIZE, block_size=64, n_layer=2, n_head=2, n_embd=64), 8),
    # ~0.82M: the default; the loss falls visibly within a minute or two on 2 CPU cores
    "small": (GPTConfig(vocab_size=VOCAB_SIZE, block_size=128, n_layer=4, n_head=4, n_embd=128), 8),
    # ~4.8M: minutes per hundred steps on CPU
    "medium": (
        GPTConfig(vocab_size=VOCAB_SIZE, block_size=256, n_layer=6, n_head=4, n_embd=256),
        8,
    ),
    # ~85M, GPT-2-small-like widths: for GPUs
    "large": (
        GPTConfig(vocab_size=VOCAB_SIZE, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        8,
    ),
}
"""name -> (model, B sequences per micro-batch)."""


ZERO_DEFAULT = ZeroConfig(stage=2, optimizer="adamw", clip_norm=1.0)
"""The engine options of a run unless the command line says otherwise."""
ZERO_DERIVED = (
    "zero.groups",
    "zero.group_of",
    "zero.units",
    "zero.micro_batches",
    "zero.scaler",
    "zero.dropout_seed",
)
"""ZeroConfig fields a run derives (from --lr, --weight-decay, --model, --micro-batches,
--seed); the others are options of the command line under their own names."""
ZERO_CHOICES = {
    "zero.stage": STAGES,
    "zero.precision": TORCH_DTYPES,
    "zero.reduce_dtype": TORCH_DTYPES,
    "zero.optimizer": TORCH_OPTIMIZERS,
    "zero.nonfinite": ("raise", "skip"),
}
"""The known values of ZeroConfig's string and stage fields, as command-line choices."""


MIN_TIMEOUT_S = 1.0
"""The shortest --timeout accepted. Every collective waits up to this long for the slowest rank,
and the ranks arrive apart: at the first collective (the ranks' agreement on the model, when the
engine is built) each rank has just started, joined the group and built its model; between two
later ones rank 0 alone writes the log, draws the loss curve and commits a checkpoint. That
stretch measured 0.5-0.7 s for the tiny GPT on 2 CPU cores (--timeout 0.5 timed out at the last
step's exchange, 0.7 finished; 0.001 fails the first collective itself, a send within 1 ms), so
below 1 s not even the smallest run can finish. Larger models need more: the watchdog then names
the collective and the rank it waited for."""
TIMEOUT_WHY = (
    "each collective waits this long for the slowest rank; before the first one every rank "
    "starts and builds its model, between later ones rank 0 alone writes logs and checkpoints "
    "(0.5-0.7 s for the tiny GPT on 2 CPU cores)"
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run of `python -m zero.workloads.train`; every field is a CLI option of the same
    name."""

    nproc: int | None = None
    """N: local ranks to spawn (None: 2), or, under torchrun, the launched world (None: any)."""
    mp: int = 1
    """N_m: tensor-parallel degree (zero/mp/, docs/design.md §6), dividing N and the model's
    heads; ZeRO then runs in each slice's data-parallel group of N_d = N/N_m ranks."""
    model: str = "small"
    """The GPT (MODELS): tiny ~0.11M parameters (tests), small ~0.82M, medium ~4.8M, large ~85M."""
    steps: int = 200
    """Total optimizer steps of the run (a resumed run continues up to this number)."""
    micro_batches: int | None = None
    """M per step, a multiple of N_d = N/mp (None: N_d, one micro-batch per data-parallel
    rank; the N_m ranks of a slice group share each micro-batch)."""
    lr: float = 2e-3
    """Learning rate (constant), every parameter."""
    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW) on matrices; none on biases and norms."""
    seed: int = 0
    """Seed of the initial parameters, the data sampling and the randomness in forward."""
    data: str | None = None
    """A text file or folder; None: the Python standard library's source."""
    val_fraction: float = 0.05
    """Share of documents (by name hash) held out for validation."""
    out: str = "runs/train"
    """Output folder: train_log.json, loss_curve.png, ckpt/."""
    eval_every: int = 50
    """Evaluate the validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation (the same ones every time), spread over ranks."""
    ckpt_every: int = 100
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    log_every: int = 10
    """Gather the per-rank memory and print a plain log line every this many steps."""
    resume: bool = False
    """Continue from OUT/ckpt/latest; without a valid checkpoint there, refused (nothing runs)."""
    resume_if_present: bool = False
    """As resume when OUT/ckpt holds anything, else a fresh start (absent or empty OUT/ckpt)."""
    timeout_s: float = 600.0
    """How long one collective may wait for the other ranks before it raises, naming the rank
    to blame (zero/ranks/watchdog.py); at least MIN_TIMEOUT_S. It does not bound the run's
    length."""
    allow_changed_run: bool = False
    """Resume even where the run's identity (RUN_IDENTITY: seed, data, model, M, precision,
    ...) differs from the checkpoint's; the differences are printed and recorded (train_log.json
    config.run_changes, and every later checkpoint). Without it such a resume is refused."""
    debug: bool = False
    """On a fault (a diverged loss, a full disk, a refused checkpoint) show the full traceback
    above the one-line error."""
    zero: ZeroConfig = ZERO_DEFAULT
    """How the engine trains; groups, units and micro-batches are filled in per run."""

    def __post_init__(self):
        def need(ok: bool, name: str, allowed: str):
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"{name}={value!r} is not allowed: expected {allowed}")

        def integer(name: str, low: int) -> bool:
            v = getattr(self, name)
            return not isinstance(v, bool) and isinstance(v, int) and v >= low

        need(self.nproc is None or integer("nproc", 1), "nproc", "an integer >= 1")
        need(self.model in MODELS, "model", f"one of {tuple(MODELS)}")
        heads = MODELS[self.model][0].n_head
        need(
            integer("mp", 1) and heads % self.mp == 0 and VOCAB_SIZE % self.mp == 0,
            "mp",
            f"an integer >= 1 dividing the model's {heads} heads and {VOCAB_SIZE} tokens",
        )
        need(
            self.nproc is None or self.nproc % self.mp == 0,
            "nproc",
            f"a multiple of mp={self.mp} (N = N_d·N_m)",
        )
        for name, low in (("steps", 1), ("eval_batches", 1), ("seed", 0), ("log_every", 1)):
            need(integer(name, low), name, f"an integer >= {low}")
        for name in ("eval_every", "ckpt_every"):
            need(integer(name, 0), name, "an integer >= 0 (0: only at the end)")
        n = (self.nproc or self.mp) // self.mp
        need(
            self.micro_batches is None
            or (integer("micro_batches", 1) and self.micro_batches % n == 0),
            "micro_batches",
            f"a positive multiple of N_d = nproc/mp = {n}",
        )

        def real(name: str) -> bool:  # finite: lr=inf would surface as a non-finite gradient
            v = getattr(self, name)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        need(real("lr") and self.lr > 0, "lr", "a finite learning rate > 0")
        need(real("weight_decay") and self.weight_decay >= 0, "weight_decay", "a finite value >= 0")
        need(
            real("val_fraction") and 0.0 < self.val_fraction < 1.0,
            "val_fraction",
            "a fraction in (0, 1)",
        )
        check_timeout(self.timeout_s)
        need(
            self.timeout_s >= MIN_TIMEOUT_S,
            "timeout_s",
            f"at least {MIN_TIMEOUT_S:g} s: {TIMEOUT_WHY}",
        )
        need(isinstance(self.out, str) and self.out != "", "out", "a folder path")
        need(isinstance(self.resume, bool), "resume", "True or False")
        need(isinstance(self.zero, ZeroConfig), "zero", "a ZeroConfig")
        need(
            not (self.resume and self.resume_if_present),
            "resume_if_present",
            "False together with resume=True (choose one)",
        )

    def zero_config(self, world_size: int) -> ZeroConfig:
        gpt, _ = MODELS[self.model]
        return replace(
            self.zero,
            groups=(Hyper(lr=self.lr, weight_decay=self.weight_decay), Hyper(lr=self.lr)),
            group_of=decay_matrices_only,
            micro_batches=self.micro_batches or world_size // self.mp,
            dropout_seed=self.seed,
            units=tuple(f"transformer.h.{i}" for i in range(gpt.n_layer)),
        )


def build_model(cfg: TrainConfig, world_size: int, device):
    """(model, data-parallel group, MPContext) of this rank: the GPT and the whole world, or
    with mp > 1 this rank's tensor-parallel slice (drawn as the plain GPT's values and cut) and
    its mesh groups."""
    gpt, _ = MODELS[cfg.model]
    if cfg.mp == 1:
        return GPT(gpt, device=device, seed=cfg.seed), None, None
    from ..collectives import CommCounter
    from ..mp import TPGPT, Mesh, MPContext

    g = Mesh(dp=world_size // cfg.mp, mp=cfg.mp).groups()
    ctx = MPContext.of(g.mp_group, counter=CommCounter(), deterministic=cfg.zero.deterministic)
    return TPGPT.build(gpt, ctx, seed=cfg.seed, device=device), g.dp_group, ctx


def parse(argv=None) -> TrainConfig:
    p = cli.new_parser("python -m zero.workloads.train", __doc__.split("\n\n")[0])
    p.add_argument(
        "--fast", dest="zero.deterministic", action="store_false", default=argparse.SUPPRESS,
        help="the same as --no-deterministic",
    )  # fmt: skip
    cfg, _ = cli.parse(
        TrainConfig, argv, parser=p, exclude=ZERO_DERIVED, aliases={"timeout_s": ("--timeout",)},
        choices={"model": MODELS, **ZERO_CHOICES},
    )  # fmt: skip
    return cfg


# ---------------------------------------------------------------------------------------------
# Before any work: OUT locked and tidied, what --resume would load


def resume_point(cfg: TrainConfig) -> Path | None:
    """The step directory the run continues from, None for a fresh start. With --resume (or
    --resume-if-present and a non-empty OUT/ckpt) a checkpoint that is missing, incomplete or
    invalid is a ValueError naming the directory and what is wrong: never a silent restart."""
    ckpt = Path(cfg.out) / "ckpt"
    if not cfg.resume and not cfg.resume_if_present:
        return None
    # the loss history (zero/workloads/history.py) is no checkpoint: rank 0 may have started it
    # already
    saved = [p for p in ckpt.iterdir() if p.name != HISTORY_FILE] if ckpt.is_dir() else []
    if cfg.resume_if_present and not saved:
        return None
    field = "resume" if cfg.resume else "resume_if_present"
    try:
        step_dir = checkpoint.resolve(ckpt)
        checkpoint.read_manifest(step_dir)
    except checkpoint.CheckpointError as exc:
        raise ValueError(
            f"{field}=True: no valid checkpoint to continue from in {ckpt} ({exc}); nothing was "
            "run or removed (without --resume a run starts afresh and keeps these files)"
        ) from None
    return step_dir


OUT_TEMP = re.compile(r"\.(train_log\.json|loss_curve\.png)\.[a-z0-9_]{8}\.tmp")
"""write_atomic's temp files of OUT's own files ([Note: leftover temp files])."""


def claim(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """Before any work: lock OUT, remove what killed writers left there (the lock's holder is
    OUT's only writer, and no rank has started: [Note: leftover temp files], [Note: crash
    leftovers]), check what --resume would load. Returns (the lock's path, the step directory
    to resume from or None)."""
    held = lock.acquire(cfg.out, say=lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(cfg.out)
    latest = out / "ckpt" / "latest"
    try:
        gone = remove_leftovers(out / "ckpt")  # before resume_point: never a checkpoint anyway
        for f in out.iterdir():
            if OUT_TEMP.fullmatch(f.name) and (f.is_file() or f.is_symlink()):
                f.unlink()
                gone.append((f, "a temp file"))
        if gone:
            names = ", ".join(f"{f.relative_to(out)} ({what})" for f, what in gone)
            print(f"note: removed what a stopped run left in {out}: {names}", file=sys.stderr)
        step_dir = resume_point(cfg)
        resuming = step_dir is not None
        if os.path.lexists(latest) and (latest.is_symlink() or not latest.is_file()):
            raise ValueError(  # else the run would fail at its first checkpoint, work lost
                f"out={cfg.out!r}: {latest} is not a regular file, so no checkpoint could be "
                "committed there; remove it, or give another --out"
            )
        if not resuming and latest.exists():
            print(
                f"note: {Path(cfg.out) / 'ckpt'} holds an earlier run's checkpoints; they are "
                "kept (a run prunes only its own), and `latest` will name this run's",
                file=sys.stderr,
            )
    except BaseException:
        lock.release(held)
        raise
    return held, step_dir


# ---------------------------------------------------------------------------------------------
# The run's identity: what a resume must not change unnoticed

RUN_IDENTITY = ("seed", "data", "val_fraction", "model", "mp", "micro_batches", "lr",
                "weight_decay", "precision", "reduce_dtype", "deterministic", "optimizer",
                "clip_norm", "nonfinite", "scaler", "chunk")  # fmt: skip
"""The options that set the data stream (seed, data, val_fraction, M: which sequences each step
reads) or the numerics (the model, N_m, the hyper-parameters, precision and reduction dtype,
deterministic or not, clipping and its chunks, loss scaling, non-finite handling) of a run. A
checkpoint records them (its extra["run"]) and `--resume` compares: any difference is refused,
naming each, unless --allow-changed-run. Not in it, because the bits do not depend on them: N and
the stage (docs/design.md §2), the memory options (offload, bucket size, ...), steps, the
evaluation, checkpoint and log cadence, --out, --timeout."""


def run_identity(cfg: TrainConfig, world_size: int, fingerprint: dict) -> dict:
    """RUN_IDENTITY's values for this run at world size N (M defaults to N_d = N/mp); the data
    by its names and content (data_identity), not by where it lies."""
    z = cfg.zero
    return {
        "seed": cfg.seed, "data": data_identity(fingerprint), "val_fraction": cfg.val_fraction,
        "model": cfg.model,
        "mp": cfg.mp, "micro_batches": cfg.micro_batches or world_size // cfg.mp, "lr": cfg.lr,
        "weight_decay": cfg.weight_decay, "precision": z.precision,
        "reduce_dtype": z.reduce_dtype, "deterministic": z.deterministic,
        "optimizer": z.optimizer, "clip_norm": z.clip_norm, "nonfinite": z.nonfinite,
        "scaler": asdict(z.scaler), "chunk": z.chunk,
    }  # fmt: skip


def data_identity(fp: dict) -> dict:
    """The data's part of the run's identity, from its fingerprint (zero/workloads/data.py):
    counts, the names (when few), and 16 hex digits of the sha256 of the names, of the contents
    alone and of both together (the one hash of the identity's old form, _old_data)."""
    return {
        "files": fp["files"], "bytes": fp["bytes"], "names": fp.get("names"),
        "names_sha256": fp["file_list_sha256"][:16], "text_sha256": fp["text_sha256"][:16],
        "sha256": fp["content_sha256"][:16],
    }  # fmt: skip


def _old_data(d: dict) -> str:
    """The data identity as checkpoints recorded it before names and contents were told apart."""
    return f"{d['files']} files, {d['bytes']} bytes, sha256 {d['sha256']}"


def data_difference(saved, now) -> str | None:
    """What differs between two data identities (data_identity): the file names, the content
    (the files' contents whatever their names) or both, or which name has which content; in
    words, None where either is not of that form."""
    keys = ("files", "bytes", "names_sha256", "text_sha256")
    if not all(isinstance(d, dict) and all(k in d for k in keys) for d in (saved, now)):
        return None
    names = saved["names_sha256"] != now["names_sha256"]
    text = saved["text_sha256"] != now["text_sha256"]
    if isinstance(saved.get("names"), list) and isinstance(now.get("names"), list):
        both = f"saved {saved['names']}, now {now['names']}"
    else:
        both = (f"saved {saved['files']} names, sha256 {saved['names_sha256']}, now "
                f"{now['files']} names, sha256 {now['names_sha256']}")  # fmt: skip
    said = [f"the file names differ: {both}"] if names else []
    if text:
        said.append(
            f"the content differs: saved {saved['bytes']} bytes, sha256 {saved['text_sha256']}, "
            f"now {now['bytes']} bytes, sha256 {now['text_sha256']}"
        )
    if said:
        same = "the file names are the same" if not names else "the content is the same"
        tail = "" if names and text else f", and {same}"
        why = " (the validation split is drawn by name)" if names and not text else ""
        return ", and ".join(said) + tail + why
    if saved.get("sha256") != now.get("sha256"):
        return "the same file names and contents, but another content under some name"
    return None


def run_changes(saved, now: dict) -> list[dict]:
    """[{field, saved, now}] for each identity field whose value differs from the saved one
    (a checkpoint without an identity, from before it was recorded, compares as unchanged), the
    data's with `why` (data_difference). A checkpoint's data in the old form (a string) is
    compared with this data in that form."""
    if not isinstance(saved, dict):
        return []
    out = []
    for k in (k for k in RUN_IDENTITY if k in now):
        was, new = saved.get(k), now[k]
        if k == "data" and isinstance(was, str) and isinstance(new, dict):
            new = _old_data(new)
        if was != new:
            why = data_difference(was, new) if k == "data" else None
            out.append({"field": k, "saved": was, "now": new, **({"why": why} if why else {})})
    return out


def describe(changes: list[dict]) -> str:
    """'--seed: saved 0, now 1; --data: the file names differ: ...'"""
    return "; ".join(
        f"--{c['field'].replace('_', '-')}: "
        + (c["why"] if c.get("why") else f"saved {c['saved']!r}, now {c['now']!r}")
        for c in changes
    )


def check_identity(cfg: TrainConfig, step_dir: Path | None, fingerprint: dict, world: int) -> None:
    """Before the ranks start: a resume must be the run its checkpoint `step_dir` was
    (RUN_IDENTITY, with the corpus's `fingerprint` at world size `world`); a difference is a
    ValueError naming each field with its saved and new value, or with --allow-changed-run a
    note (the ranks record it)."""
    if step_dir is None:
        return
    saved = read_manifest(step_dir)["extra"]
    saved = saved.get("run") if isinstance(saved, dict) else None
    if saved is None:
        print(f"note: {step_dir} records no run identity (an older checkpoint): not compared")
    changes = run_changes(saved, run_identity(cfg, world, fingerprint))
    if not changes:
        return
    if not cfg.allow_changed_run:
        field = "resume" if cfg.resume else "resume_if_present"
        raise ValueError(
            f"{field}=True: the run differs from the one {step_dir} was saved by: "
            f"{describe(changes)}; resume with the saved values, or pass --allow-changed-run "
            "(recorded in the log and in every later checkpoint)"
        )
    print(f"note: --allow-changed-run: resuming {step_dir} with {describe(changes)}", flush=True)
