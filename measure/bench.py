"""python -m measure.bench: one training step of our stages 0-3 timed beside torch DDP,
ZeroRedundancyOptimizer, FSDP2 and DeepSpeed ZeRO-1/2/3, same GPT, same data, same N, one run,
then each system's peak tensor bytes per rank. DeepSpeed runs where it is installed
(`DS_BUILD_OPS=0 pip install deepspeed`; on a CPU the benchmark sets DS_ACCELERATOR=cpu); where
it is not, its rows say "not installed" and the other systems run.

    python -m measure.bench --model anchor --world-sizes 2 4 --repeats 8 --steps 6 --json b.json
    python -m measure.bench --model mid --world-sizes 2 4 --json mid.json   # 26.3M, fewer steps
    python -m measure.bench --from-json b.json --markdown          # the tables again, from records
    torchrun --standalone --nproc-per-node 1 -m measure.bench --world-sizes 1   # one GPU, NCCL

Systems (SYSTEMS): zero-s{0..3} (fast mode), zero-s{0..3}-det (deterministic), ddp,
zero-redundancy, fsdp2, fsdp2-reshard, deepspeed-s{1,2,3}; fp32 AdamW, M = N. Model parallelism
(named only, never by default): megatron-lm, zero-s{0..3}-mp{1,2,4}[-det] (measure/bench_mp.py).
Memory (--memory, on by default; [Note: the memory pass] in measure/parts/bench_ranks.py): peak
MiB per rank, measured by measure/tensor_memory.py, beside the analytic model states of the
system's sharding level (zero/common/memory.py) and the activations autograd saves; ×DDP and
×best peer at the same level; for ours, the bound derived from the model's shape ([Note: the
memory bound] in measure/bench_table.py) and the peak over it.
Legend: N ranks; ms/step the slowest rank's step, median over repeats × steps (IQR its spread);
×DDP / ×fast / ×s2 / ×<peer> ratios of medians; MFU model FLOPs ÷ step time ÷ measured peak
(measure/mfu.py); Δloss the largest loss difference from DDP. Every system, column and rule is
described in benchmarks/cpu-2core-2026-11.md, section "How the step time is taken".
This module is the driver and the command line; what each rank runs is
measure/parts/bench_ranks.py, the records measure/parts/bench_records.py, the systems
measure/parts/trainers.py (BenchConfig, MODELS: importable from here).
"""

# [Note: alternating repeats] Machine noise comes in bursts of seconds, so repeats go round-robin
# over the systems (repeat 1 of every system, then repeat 2, ...), each round starting one system
# further along; every system lives in the same worker processes, built once. A barrier lines the
# ranks up before each timed step, whose time is the slowest rank's. Speed is reported, never
# asserted: tests check the records.
#
# [Note: disturbed repeats] With local ranks on Linux the driver measures how many cores *other*
# processes used during each repeat (/proc/stat's busy time minus our ranks' and our own). A repeat
# during which they used more than quiet_cores is timed again (up to `retries` times), and before
# each repeat the driver waits (at most quiet_wait_s) for a quiet machine. Every repeat's figure is
# kept in its record ("other_cores"). This drops disturbed samples; it never selects fast ones.

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from zero.common import cli
from zero.common.results import provenance, read_json, write_json

from .bench_table import (  # noqa: F401  (OURS, analytic_states_bytes: importable from here)
    OURS,
    SYSTEMS,
    add_ratios,
    analytic_states_bytes,
    format_all,
    merge_records,
)
from .parts import bench_ranks as in_rank
from .parts.bench_config import MODELS, BenchConfig
from .parts.bench_ranks import BUILD_WARMUP, MEMORY_STEPS, prepare_deepspeed  # noqa: F401
from .parts.bench_ranks import make as _make  # noqa: F401  (a system in this rank, for tests)
from .parts.bench_ranks import memory as _memory  # noqa: F401  ([Note: the memory pass])
from .parts.bench_records import KIND, record
from .parts.bench_records import record as _record  # noqa: F401  (one record, for tests)
from .parts.trainers import rank_device

# ---------------------------------------------------------------------------------------------
# The driver (the parent process, or every rank under torchrun)


class _World:
    """Runs fn(rank, N, *args) on every rank of one world, returning the results in rank order:
    through a pool of forked local ranks, or on this rank of a torchrun world, gathered."""

    def __init__(self, n: int, pool=None, timeout_s: float = 900.0):
        self.n, self.pool, self.timeout_s = n, pool, timeout_s

    def run(self, fn, *args) -> list:
        if self.pool is not None:
            return self.pool.run(fn, *args, timeout_s=self.timeout_s)
        mine = fn(dist.get_rank(), self.n, *args)
        every: list = [None] * self.n
        dist.all_gather_object(every, mine)
        return every


def bench_world(n: int, cfg: BenchConfig, *, pool=None, say=print) -> list[dict]:
    """Build every system of cfg in one world of n ranks, time them round-robin, and return
    one zero.common.results record per system (status "ok", "not installed", "unavailable: ...", or
    "failed"). `pool`: a zero.ranks.launch WorkerPool of n ranks, or None under torchrun."""
    world = _World(n, pool, cfg.timeout_s)
    if cfg.malloc == "keep":  # before any system allocates: every one runs under it
        world.run(in_rank.keep_freed_blocks)
    built: dict[str, list[dict]] = {}
    for name in cfg.systems:
        t0 = time.perf_counter()
        built[name] = world.run(in_rank.build, name, cfg)
        status = {b["status"] for b in built[name]}
        say(f"  N={n} {name}: {'/'.join(sorted(status))} ({time.perf_counter() - t0:.1f} s)")
    ready = [s for s in cfg.systems if all(b["status"] == "ok" for b in built[s])]
    # [Note: alternating repeats]
    timings: dict[str, list[list[dict]]] = {s: [] for s in ready}
    redone: dict[str, list[float]] = {s: [] for s in ready}
    meter = _Meter(cfg) if pool is not None else None  # other hosts' load is not visible here
    for r in range(cfg.repeats):
        t0 = time.perf_counter()
        order = ready[r % len(ready) :] + ready[: r % len(ready)] if ready else []
        for name in order:
            per_rank, noisy = _undisturbed(
                world, meter, cfg, in_rank.repeat, name, cfg.steps, cfg.warmup
            )
            timings[name].append(per_rank)
            redone[name] += noisy
        others = [timings[s][-1][0]["other_cores"] for s in order]
        busiest = max((x for x in others if x is not None), default=None)
        say(
            f"  N={n} repeat {r + 1}/{cfg.repeats} ({time.perf_counter() - t0:.1f} s"
            + ("" if busiest is None else f"; others used <= {busiest:.2f} cores")
            + f"; {sum(len(v) for v in redone.values())} repeats redone so far)"
        )
    peaks = _undisturbed(world, meter, cfg, in_rank.peak)[0] if ready else None
    profiles = {}
    if cfg.profile:
        for name in ready:
            per_rank, _ = _undisturbed(world, meter, cfg, in_rank.profile, name, cfg.steps)
            profiles[name] = [x["phases"] for x in per_rank]
    memory = {}
    if cfg.memory:
        world.run(
            in_rank.drop_all
        )  # the timed copies are not needed any more: room for the fresh ones
        for name in ready:
            memory[name] = world.run(in_rank.memory, name, cfg)
            say(
                f"  N={n} {name}: peak {max(m['peak_bytes'] for m in memory[name]) / 2**20:.1f} MiB"
            )
    world.run(in_rank.drop_all)
    prov = provenance()
    return [
        record(
            name, n, cfg, built[name], timings.get(name), profiles.get(name), prov, redone, peaks,
            memory.get(name),
        )
        for name in cfg.systems
    ]  # fmt: skip


def _undisturbed(world: _World, meter, cfg: BenchConfig, fn, *args) -> tuple[list, list]:
    """world.run(fn, *args), timed again while others used more than cfg.quiet_cores
    ([Note: disturbed repeats]). fn returns a dict per rank with "cpu_s"; each gets
    "other_cores" and "waited_s". Returns (the kept results, other_cores of those redone)."""
    redone = []
    for attempt in range(cfg.retries + 1):
        waited = meter.wait_quiet() if meter else 0.0
        before = meter.read() if meter else None
        per_rank = world.run(fn, *args)
        other = meter.other_cores(before, per_rank) if meter else None
        for x in per_rank:
            x.update(other_cores=other, waited_s=waited)
        if other is None or other <= cfg.quiet_cores or attempt == cfg.retries:
            return per_rank, redone
        redone.append(other)
    raise AssertionError("unreachable: the last attempt returns")


class _Meter:
    """CPU time of the whole machine (Linux /proc/stat), so that the parent can tell how many
    cores processes other than ours used while a repeat ran ([Note: disturbed repeats]).

    Our own CPU time is the ranks' process times (every thread, gloo's included) plus this
    process's; the rest of the machine's busy time belongs to others."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def busy(self) -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                cpu = f.readline().split()
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy
        ticks = [int(x) for x in cpu[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / self.tick

    def read(self) -> tuple[float | None, float, float]:
        return self.busy(), time.process_time(), time.perf_counter()

    def other_cores(self, before, per_rank: list[dict] | None = None) -> float | None:
        busy, cpu, wall = self.read()
        if busy is None or before[0] is None:
            return None
        ours = (cpu - before[1]) + sum(x["cpu_s"] for x in per_rank or ())
        return max(0.0, (busy - before[0] - ours) / max(wall - before[2], 1e-9))

    def wait_quiet(self) -> float:
        """Wait (probing half a second at a time, at most quiet_wait_s) until others use at most
        quiet_cores while our ranks sit idle; returns the seconds waited."""
        if self.cfg.quiet_wait_s <= 0:
            return 0.0
        t0 = time.perf_counter()
        while True:
            before = self.read()
            time.sleep(0.5)
            other = self.other_cores(before)
            waited = time.perf_counter() - t0
            if other is None or other <= self.cfg.quiet_cores or waited >= self.cfg.quiet_wait_s:
                return waited


def run_bench(cfg: BenchConfig, *, pools=None, say=print, done=None) -> list[dict]:
    """Every world size of cfg; returns the records with ratios filled in.

    pools: a function N -> WorkerPool to run in (e.g. zero.ranks.local.get_pool); None starts a
    fresh pool per N and closes it afterwards. Under torchrun, only the launched world size runs.
    done: called with the records so far after each world size (main writes them, so that a
    failure at one N keeps the measurements of the others).
    """
    from zero.ranks import launch, local

    records = []
    if launch.under_torchrun():
        if not dist.is_initialized():
            launch.init_from_env()
        if rank_device().type == "cpu":
            torch.set_num_threads(1)  # as the forked ranks have: one thread per rank
        n = dist.get_world_size()
        records += bench_world(n, cfg, say=say)
    else:
        for n in cfg.world_sizes:
            if pools is not None:
                records += bench_world(n, cfg, pool=pools(n), say=say)
            else:
                with local.WorkerPool(n, timeout_s=cfg.timeout_s) as pool:
                    records += bench_world(n, cfg, pool=pool, say=say)
            if done is not None and n != cfg.world_sizes[-1]:
                add_ratios(records)
                done(records)
    add_ratios(records)
    return records


def parse(argv=None) -> tuple[BenchConfig, argparse.Namespace]:
    """The configuration and the output options of a command line."""
    p = cli.new_parser("python -m measure.bench", __doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--from-json", nargs="+", default=None,
        help="print the tables of results files only (several: merged; with --json, written)",
    )  # fmt: skip
    return cli.parse(
        BenchConfig, argv, parser=p, aliases={"timeout_s": ("--timeout",)},
        choices={"model": MODELS, "systems": SYSTEMS},
    )  # fmt: skip


def read_results(path: str) -> list[dict]:
    """The records of a results file of `python -m measure.bench --json`; a ValueError naming
    the file and what is wrong with it (unreadable, not UTF-8 JSON, not such a file)."""
    allowed = "allowed are results files of python -m measure.bench --json"
    if not os.path.isfile(path):
        raise ValueError(f"from_json={path!r}: no such file; {allowed}")
    try:
        data = read_json(path)
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"from_json={path!r}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}); {allowed}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"from_json={path!r}: not JSON ({exc}); {allowed}") from None
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ValueError(f"from_json={path!r}: cannot be read ({why}); {allowed}") from None
    records = data.get("records") if isinstance(data, dict) else None
    if not isinstance(records, list):
        raise ValueError(f"from_json={path!r}: has no list of 'records'; {allowed}")
    for i, r in enumerate(records):
        if not (
            isinstance(r, dict)
            and isinstance(r.get("config"), dict)
            and isinstance(r.get("result"), dict)
            and {"system", "world_size"} <= set(r["config"])
            and "status" in r["result"]
        ):
            raise ValueError(
                f"from_json={path!r}: records[{i}] is not a step-time record (config.system, "
                f"config.world_size, result.status); {allowed}"
            )
    return records


def main(argv=None) -> int:
    cfg, args = parse(argv)
    # every file read before anything is printed or written: one line naming a bad one
    runs = [read_results(path) for path in args.from_json or ()]
    if args.json is not None:
        cli.check_writable("json", args.json, file=True)  # before the timing, not after it
    if args.from_json:
        records = merge_records(runs)
        add_ratios(records)  # the ratios follow from the timings; recomputed, never trusted
        if args.json is not None:
            write_json(args.json, {"section": KIND, "records": records})
        print("\n\n".join(format_all(records, markdown=args.markdown)))
        return 0
    lead = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 alone prints and writes

    def say(*a):
        if lead:
            print(*a, flush=True)

    def keep(records):
        if args.json and lead:
            write_json(args.json, {"section": KIND, "records": records})

    started = time.time()
    records = run_bench(cfg, say=say, done=keep)
    say("\n\n".join(format_all(records, markdown=args.markdown)))
    psi = next((r["config"]["num_params"] for r in records if "num_params" in r["config"]), 0)
    say(
        f"model {cfg.model}: Ψ = {psi:,}, B = {cfg.workload.batch_size}, "
        f"seq {cfg.workload.gpt.block_size}; {time.time() - started:.0f} s"
    )
    keep(records)
    return 0 if any(r["result"]["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    cli.run(main, "python -m measure.bench")
