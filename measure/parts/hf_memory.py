"""python -m measure.parts.hf_memory: what export_hf and init_from_hf add to a rank's memory.

    python -m measure.parts.hf_memory                       # a 1.1B Llama, N = 2, stage 3
    python -m measure.parts.hf_memory --layers 2 --width 256 --vocab 1024   # a quick one

A Llama (TinyLlama's shape by default: 22 layers, width 2048, MLP 5632, 32 heads, 4 KV heads,
vocabulary 32000: 1.10B parameters) is built with its parameters on the meta device
(zero.checkpoint.hf.meta_model's way), wrapped at stage 3 on N local ranks (fp32, SGD without
momentum: the master is the working copy, so a rank holds 4Ψ/N of parameters and 4Ψ/N of
gradients), every unit filled with values, then exported with export_hf into --dir and read back
with init_from_hf into the same engine. For each call, on each rank: its seconds, and the peak of
the process's anonymous resident memory (RssAnon, sampled every 5 ms by a thread) and of its
file-backed resident memory (RssFile: the safetensors files' pages that init_from_hf's mapped
reads touch, clean page cache the kernel may drop) above their values before the call. What
bounds the export's growth: rank 0 holds one gathered unit (the root unit, embeddings and
lm_head, is the largest), the other ranks nothing; the import's: one unit's held extent (its
values) and one parameter's slice at a time. The folder is removed afterwards unless --keep.
Prints one JSON record (zero.common.results).

Measured on the 2-core, 23 GiB machine (1.10B parameters, N = 2, the folder 4.40 GB in 6 files,
each rank holding 4.69 GB before the calls): export 30.7 s, rank 0 +524.5 MB anonymous (its
largest unit, padded: 524.3 MB), rank 1 +0.1 MB; init_from_hf 9.1 s, each rank +262 MB
anonymous (its shard of the root unit) and +2.2 GB file-backed (the pages of its 2.20 GB of
shards, exactly the bytes it read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

from zero.common import cli
from zero.common.results import make_record

PROG = "python -m measure.parts.hf_memory"
KIND = "hf_memory.run"


def _status_kb(*names: str) -> dict[str, int]:
    """Fields of /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in names:
                out[key] = int(rest.split()[0]) * 1024
    return out


@contextlib.contextmanager
def sampled(into: dict, period_s: float = 0.005):
    """Peak RssAnon and RssFile above their values at entry, and the seconds taken, into `into`."""
    start = _status_kb("RssAnon", "RssFile")
    peak = dict(start)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for k, v in _status_kb("RssAnon", "RssFile").items():
                peak[k] = max(peak[k], v)
            stop.wait(period_s)

    thread = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for k, v in _status_kb("RssAnon", "RssFile").items():
            peak[k] = max(peak[k], v)
        into.update(
            seconds=round(time.perf_counter() - t0, 2),
            anon_growth=peak["RssAnon"] - start["RssAnon"],
            file_growth=peak["RssFile"] - start["RssFile"],
            anon_before=start["RssAnon"],
        )


def build(args, n: int):
    """The meta-device Llama wrapped at stage 3 on this rank, every unit filled."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from measure.resident import release_free_memory
    from reference import Hyper
    from zero.checkpoint.hfread import parameters_on_meta
    from zero.config import ZeroConfig
    from zero.engine import ZeroEngine

    config = LlamaConfig(
        hidden_size=args.width, intermediate_size=args.mlp, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    with parameters_on_meta():
        model = LlamaForCausalLM(config)
    cfg = ZeroConfig(
        stage=3, micro_batches=n, units="auto", optimizer="sgd", groups=(Hyper(lr=1e-3),)
    )
    eng = ZeroEngine(model, cfg, device="cpu", init_seed=None)
    with torch.no_grad():
        for u in eng.units:  # values in every page, as trained weights would be
            resident, _ = eng.working_extent(u)
            resident.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(u.index))
    release_free_memory()
    return model, eng


def rank_main(rank: int, n: int, args) -> dict:
    from zero.checkpoint.hf import export_hf, init_from_hf

    model, eng = build(args, n)
    params = sum(p.numel() for p in model.parameters())
    units = [u.part.padded_numel * 4 for u in eng.units]
    out = {"rank": rank, "params": params, "largest_unit_bytes": max(units)}
    out["rank_model_bytes"] = sum(u.part.shard_numel * 4 for u in eng.units)
    folder = Path(args.dir) / "hf"
    export: dict = {}
    with sampled(export):
        export_hf(eng, model, folder, max_shard_bytes=args.shard_gib * 2**30)
    read: dict = {}
    with sampled(read):
        info = init_from_hf(eng, folder)
    read["bytes_read"] = info.bytes_read
    out.update(export=export, init=read)
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
    p.add_argument("--shard-gib", type=int, default=2, help="max_shard_bytes, in GiB")
    p.add_argument("--dir", default=None, help="where the folder is written (a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the exported folder")
    return p


def check(args) -> None:
    for name in ("layers", "width", "mlp", "heads", "kv_heads", "vocab", "nproc", "shard_gib"):
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


def main(argv=None) -> int:
    from zero.ranks.local import spawn

    args = parser().parse_args(argv)
    check(args)
    made = args.dir is None
    if made:
        args.dir = tempfile.mkdtemp(prefix="hf_memory.")
    try:
        per_rank = spawn(rank_main, args.nproc, args, timeout_s=3600)
    finally:
        if not args.keep:
            shutil.rmtree(Path(args.dir) / "hf", ignore_errors=True)
            if made:
                shutil.rmtree(args.dir, ignore_errors=True)
    config = {k: v for k, v in vars(args).items() if k not in ("dir", "keep")}
    record = make_record(config=config, result={"ranks": per_rank}, kind=KIND)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    cli.run(main, PROG)
