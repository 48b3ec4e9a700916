"""python -m measure.parts.dcp_memory: what save_dcp and load_dcp add to a rank's memory.

    python -m measure.parts.dcp_memory                       # a 1.1B Llama, N = 2, stage 3
    python -m measure.parts.dcp_memory --layers 2 --width 256 --mlp 512 --vocab 1024  # quick

The model of measure/parts/hf_memory.py (a Llama of TinyLlama's shape by default, 1.10B
parameters, built on the meta device, wrapped at stage 3 on N local ranks, fp32, SGD without
momentum, every unit filled with values) is saved with save_dcp into --dir and loaded back with
load_dcp into the same engine. For each call, on each rank: its seconds; the peak of the
process's resident memory above its value before the call, as the kernel tracks it (VmHWM, reset
through /proc/self/clear_refs just before the call); and the peaks of anonymous (RssAnon) and
file-backed (RssFile) resident memory above theirs, sampled every 5 ms.

Beside each, the analytic bound of its growth ([Note: DCP memory bound]), from the engine's
extents: for save_dcp the fp32 copies of its frozen values plus one chunk of headroom (a
rank's largest chunk is at most one unit's shard); for load_dcp its fresh targets (step counts
and buffers; everything else is read in place) plus its two largest chunks. The folder is
removed afterwards unless --keep. Prints one JSON record (zero.common.results).

[Note: DCP memory bound] save_dcp hands DCP its own memory ([Note: DCP writes in place] in
zero/checkpoint/dcp_plan.py), so on CPUs DCP copies no tensor: what grows is the fp32 copies of
frozen values (none when nothing is frozen or it is fp32 already), held throughout, and DCP's
bookkeeping (plans, metadata), which the one chunk of headroom covers. (On a device DCP copies
each chunk to the host and keeps the copies until the rank's file is closed: not measured
here.) load_dcp reads the master, the optimizer states and frozen values straight into the
engine's own buffers ([Note: DCP reads] in zero/checkpoint/dcp.py) and only the step counts and
buffers into fresh tensors (its targets);
DCP's reader torch.loads one saved chunk at a time into a tensor of its own, copies it into
place, and drops it when it rebinds its name to the next (two chunks alive for a moment):
growth ≤ targets + the two largest saved chunks it reads (at the same N and stage, the rank's
own chunks).

Measured on the 2-core, 23 GiB machine (1.10B parameters, N = 2, each rank holding 4.69 GB, its
master shard 2.20 GB; the folder 4.40 GB in 3 files): save_dcp 9.6 s, +12.0 MB and +7.2 MB
(bound 262 MB); load_dcp 0.8 s, +285 MB and +306 MB (bound 308 MB; reading into a fresh copy of
the shard it grew by 2.46 and 2.51 GB). More in docs/checkpoints.md ("DCP: exchange with plain
PyTorch and FSDP2") and benchmarks/status-details.md ("checkpoints that travel").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
from pathlib import Path

from measure.parts.hf_memory import build, sampled
from zero.common import cli
from zero.common.results import make_record

PROG = "python -m measure.parts.dcp_memory"
KIND = "dcp_memory.run"
MODEL_ARGS = ("layers", "width", "mlp", "heads", "kv_heads", "vocab")


def _status(name: str) -> int:
    """A field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key == name:
                return int(rest.split()[0]) * 1024
    raise KeyError(name)


def reset_peak() -> bool:
    """Set VmHWM to the current VmRSS (Linux 4.0 and later); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def measured(into: dict):
    """hf_memory.sampled's fields, and the kernel's own peak above VmRSS at entry (hwm_growth,
    None where VmHWM cannot be reset)."""
    exact = reset_peak()
    before = _status("VmRSS")
    with sampled(into):
        yield
    into["hwm_growth"] = _status("VmHWM") - before if exact else None


def bounds(eng) -> dict[str, int]:
    """The rank's sizes in bytes and the bounds of [Note: DCP memory bound], from its extents
    (fp32: 4 bytes an element). Allocates nothing: the chunks are views."""
    from zero.checkpoint.dcp_plan import param_keys, save_chunks

    sizes = sorted(4 * c.flat.numel() for c in save_chunks(eng, param_keys(eng)[0]))
    targets = 4 * len(eng.group_index) if eng.config.optimizer != "sgd" else 0  # step counts
    persistent = eng.module.state_dict(keep_vars=True)
    targets += sum(b.nbytes for k, b in eng.module.named_buffers() if k in persistent)
    frozen = sum(4 * (u.part.own.stop - u.part.own.start) for u in eng.frozen_units)
    return {
        "rank_shard_bytes": sum(4 * u.part.shard_numel * (1 + len(u.opt)) for u in eng.units),
        "largest_unit_shard_bytes": max(4 * u.part.shard_numel for u in eng.units),
        "largest_chunk_bytes": sizes[-1] if sizes else 0,
        "chunks": len(sizes),
        "load_targets_bytes": targets,
        "save_bound": frozen + (sizes[-1] if sizes else 0),
        "load_bound": targets + sum(sizes[-2:]),
    }


def rank_main(rank: int, n: int, args) -> dict:
    from zero.checkpoint.dcp import load_dcp, save_dcp

    model, eng = build(args, n)
    out = {"rank": rank, "params": sum(p.numel() for p in model.parameters()), **bounds(eng)}
    folder = Path(args.dir) / "dcp"
    save: dict = {}
    with measured(save):
        save_dcp(eng, folder)
    load: dict = {}
    with measured(load):
        info = load_dcp(eng, folder)
    load["elements_read"] = info.elements_read
    out.update(save=save, load=load)
    if rank == 0:
        out["folder_bytes"] = sum(p.stat().st_size for p in folder.iterdir())
        out["files"] = len(list(folder.iterdir()))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the folder is written (a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    return p


def check(args) -> None:
    for name in (*MODEL_ARGS, "nproc"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value}: allowed is an integer >= 1")
    if args.width % args.heads or args.heads % args.kv_heads:
        raise ValueError(
            f"--width={args.width} --heads={args.heads} --kv-heads={args.kv_heads}: allowed "
            "are heads dividing the width and KV heads dividing the heads"
        )
    if args.dir is not None and not Path(args.dir).is_dir():
        raise ValueError(f"--dir={args.dir!r}: not a folder; allowed is an existing folder")
    if args.dir is not None and (Path(args.dir) / "dcp").exists():
        raise ValueError(f"--dir={args.dir!r}: holds dcp/ already; allowed is a folder without")


def summary(per_rank: list[dict]) -> dict:
    """Each call's worst growth over the ranks as a fraction of its bound (kernel peaks where
    known, else the sampled anonymous peak)."""
    out = {}
    for call in ("save", "load"):
        worst = 0.0
        for r in per_rank:
            grew = r[call]["hwm_growth"]
            grew = r[call]["anon_growth"] if grew is None else grew
            worst = max(worst, grew / max(1, r[f"{call}_bound"]))
        out[f"{call}_growth_over_bound"] = round(worst, 4)
    return out


def main(argv=None) -> int:
    from zero.ranks.local import spawn

    args = parser().parse_args(argv)
    check(args)
    made = args.dir is None
    if made:
        args.dir = tempfile.mkdtemp(prefix="dcp_memory.")
    try:
        per_rank = spawn(rank_main, args.nproc, args, timeout_s=3600)
    finally:
        if not args.keep:
            shutil.rmtree(Path(args.dir) / "dcp", ignore_errors=True)
            if made:
                shutil.rmtree(args.dir, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k not in ("dir", "keep")}
    result = {"ranks": per_rank, **summary(per_rank)}
    record = make_record(config=config, result=result, kind=KIND)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    cli.run(main, PROG)
