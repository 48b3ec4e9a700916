"""verify's refusals section: bad input and damaged checkpoints must be refused, by name.

The cells feed valid input to healthy ranks, so the library's refusals never ran under verify:
a refusal that stopped refusing (a check deleted, a message that no longer names its field)
passed every cell. Each row here is (what is done wrong, the call that does it, the exception
type that must be raised, the text its message must contain), all stated in the row: the
expected side is the row, never what the library says (verify/refusals/rows.py judges it). A row
passes when its call raises that type with that text; one that raises nothing ("accepted"),
raises another type, or names something else fails, and says which. Rows run where they can:
  - here, in this process (this module): configurations, models, meshes, initialisation rules,
    the memory model and the traffic counter, zero/ranks' checks of a world's arguments and of a
    launcher's environment, and ranks that fail (each forked alone);
  - on every rank of a local pool of N = 1 or 2 (verify/refusals/ranks.py): engines built on a
    wrong model, config or world, engine calls out of order, saves and loads that must fail;
  - here again, on copies of the checkpoints those ranks saved, each damaged in one way
    (verify/refusals/damage.py): zero.checkpoint.verify or consolidate must refuse each copy with
    a CheckpointError naming the manifest's field or the file.
Launched plainly only (the pools are local); under torchrun the section says so and is skipped.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

import torch

from zero.config import ZeroConfig
from zero.materialize import ParamInit, init_parameters
from zero.mp import Mesh, split_state
from zero.workloads.lora import add_lora
from zero.workloads.models import GPT, MLP, GPTConfig, MLPConfig, mlp_microbatches

from ..checks.report import guarded
from .rows import SMALL_GPT, Refusal, judge_here, result

NOWHERE = str(Path(tempfile.gettempdir()) / "zero-refusals-no-such-directory" / "x")


def _config(**kw):
    return lambda: ZeroConfig(**kw)


def config_rows() -> list[Refusal]:
    """ZeroConfig's own checks (zero/config.py): one row per distinct refusal, each naming
    the field and the value (verify/refusals/bad_inputs.py tries more values per field, in the
    tests)."""
    bad = [
        ("stage 4", dict(stage=4), "stage=4: allowed are"),
        ("deterministic a string", dict(deterministic="yes"), "deterministic='yes'"),
        ("an unknown watchdog mode", dict(watchdog="every"), "watchdog='every'"),
        ("no micro-batches", dict(micro_batches=0), "micro_batches=0: must be an integer >= 1"),
        ("a chunk not a power of two", dict(chunk=100), "chunk=100: must be a power of two"),
        ("the optimizer a boolean", dict(optimizer=True), "optimizer=True: not a boolean"),
        ("group_of not callable", dict(group_of=3), "group_of=3: must be None or a callable"),
        ("overlap a string", dict(overlap="yes"), "overlap='yes': must be True or False"),
        ("release_grads a string", dict(release_grads="yes"), "release_grads='yes'"),
        ("a negative dropout seed", dict(dropout_seed=-1), "dropout_seed=-1"),
        ("P_a without checkpointing", dict(partition_activations=True),
         "partition_activations=True: P_a partitions the checkpointed unit inputs"),
        ("activation offload without checkpointing", dict(offload_activations=True),
         "offload_activations=True: only checkpointed unit inputs are offloaded"),
        ("an empty bucket", dict(bucket_elements=0), "bucket_elements=0: must be None or"),
        ("no ranks on a node", dict(ranks_per_node=0),
         "ranks_per_node=0: must be None or an integer >= 1"),
        ("qwZ at stage 2", dict(stage=2, qwz_bits=8),
         "qwz_bits=8: ZeRO++ quantizes stage 3's collectives; allowed with stage=3"),
        ("qgZ in int2", dict(stage=3, qgz_bits=2), "qgz_bits=2: allowed are None (off) and (8, 4)"),
        ("a quantization block not dividing the shard", dict(stage=3, qwz_bits=8, quant_block=384),
         "quant_block=384: a block must divide every unit's shard"),
        ("qgZ's float32 scales in bf16 gradients",
         dict(stage=3, precision="bf16", reduce_dtype="bf16", qgz_bits=4),
         "with reduce_dtype='bf16': qgZ carries a float32 scale per block"),
        ("qgZ in C_B pieces", dict(stage=3, qgz_bits=4, bucket_elements=1024),
         "qgz_bits=4 with bucket_elements=1024: qgZ quantizes each unit's whole gradient"),
        ("hierarchical sharding at stage 0", dict(shard_group_size=2),
         "shard_group_size=2: hierarchical sharding shards inside groups of G ranks; stage 0"),
        ("a group of 3 in deterministic mode", dict(stage=1, shard_group_size=3),
         "shard_group_size=3: deterministic mode keeps the reference's sum over the N ranks"),
        ("hierarchical sharding with hpZ", dict(stage=3, shard_group_size=2, hpz=True),
         "shard_group_size=2 with hpz=True: hpZ's node parts over a sharded group"),
        ("hierarchical sharding with qwZ", dict(stage=3, shard_group_size=2, qwz_bits=8),
         "qwz_bits=8 with shard_group_size=2: quantized collectives over a sharded group"),
        ("units a word", dict(units="everything"), "units='everything': a tuple of submodule"),
        ("a unit named twice", dict(units=("a", "a")), "units=('a', 'a'): names must be distinct"),
        ("a disk tier not a path", dict(offload_optimizer=True, offload_dir=5),
         "offload_dir=5: must be None or a directory path"),
        ("a disk tier without optimizer offload", dict(offload_dir=tempfile.gettempdir()),
         "the disk tier holds the offloaded optimizer states; allowed with offload_optimizer=True"),
        ("a disk tier in no directory", dict(offload_optimizer=True, offload_dir=NOWHERE),
         f"offload_dir={NOWHERE!r}: not an existing, writable directory"),
    ]  # fmt: skip
    return [Refusal(f"config: {w}", "config", _config(**kw), ValueError, s) for w, kw, s in bad]


def _meta_init():
    init_parameters(MLP(MLPConfig(d_in=4, d_hidden=4, d_out=2, n_layer=2), device="meta"), 0)


def _long_sequence():
    model = GPT(GPTConfig(**SMALL_GPT))
    model(torch.zeros(1, SMALL_GPT["block_size"] + 1, dtype=torch.long))


def model_rows() -> list[Refusal]:
    """The models', meshes' and initialisation rules' own checks, without a process group."""
    mlp = lambda: MLP(MLPConfig(d_in=4, d_hidden=8, d_out=2, n_layer=2))  # noqa: E731
    gpt = lambda **kw: GPTConfig(**{**SMALL_GPT, **kw})  # noqa: E731
    rows = [
        ("models", "a width not a multiple of the heads", lambda: gpt(n_embd=33),
         ValueError, "n_embd=33 is not allowed: expected a multiple of n_head=2"),
        ("models", "dropout 1", lambda: gpt(dropout=1.0), ValueError, "dropout=1.0"),
        ("models", "a GPT's bias a string", lambda: gpt(bias="yes"), ValueError, "bias='yes'"),
        ("models", "an MLP's bias an integer", lambda: MLPConfig(bias=1), ValueError, "bias=1"),
        ("models", "a sequence beyond block_size", _long_sequence, ValueError,
         "sequence length=17 is not allowed: expected at most block_size=16"),
        ("models", "a negative data seed", lambda: mlp_microbatches(
            MLPConfig(), seed=-1, data_step=0, count=1, batch_size=2), ValueError, "seed=-1"),
        ("materialize", "a mesh of no DP ranks", lambda: Mesh(dp=0, mp=1), ValueError,
         "dp=0 is not allowed: expected an integer >= 1"),
        ("materialize", "an unknown init kind", lambda: ParamInit(kind="uniform"), ValueError,
         "kind='uniform' is not allowed"),
        ("materialize", "a zero init std", lambda: ParamInit(kind="normal", std=0.0), ValueError,
         "std=0.0 is not allowed: expected a finite float > 0"),
        ("materialize", "values for a meta model", _meta_init, ValueError,
         "parameter 'layers.0.weight' is on the meta device"),
        ("mp/mesh", "a rank outside the mesh", lambda: Mesh(dp=2, mp=2).coords(4), ValueError,
         "rank=4 is not allowed: expected an integer in [0, 4)"),
        ("mp/mesh", "an MP index outside the mesh", lambda: Mesh(dp=2, mp=2).rank_of(0, 2),
         ValueError, "m=2 is not allowed: expected an integer in [0, 2)"),
        ("mp/mesh", "groups without a process group", lambda: Mesh(dp=1, mp=2).groups(),
         RuntimeError, "Mesh.groups needs an initialised process group"),
        ("mp/gpt", "heads not divisible by N_m", lambda: split_state({}, gpt(n_head=1), m=0, n=2),
         ValueError, "n_head=1 is not allowed: expected a multiple of mp=2"),
        ("mp/gpt", "a vocabulary not divisible by N_m",
         lambda: split_state({}, gpt(vocab_size=63), m=0, n=2), ValueError, "vocab_size=63"),
        ("mp/gpt", "dropout with model parallelism",
         lambda: split_state({}, gpt(dropout=0.1), m=0, n=1), ValueError,
         "dropout=0.1 is not allowed: expected 0.0 with model parallelism"),
        ("workloads/lora", "LoRA of rank 0", lambda: add_lora(mlp(), rank=0), ValueError,
         "rank=0 is not allowed: expected an integer >= 1"),
        ("workloads/lora", "LoRA on no module", lambda: add_lora(mlp(), targets=lambda n, m: False),
         ValueError, "a rule that picks at least one linear module"),
    ]  # fmt: skip
    return [Refusal(f"{mod}: {what}", mod, make, err, says) for mod, what, make, err, says in rows]


def raise_on_purpose(rank: int, world_size: int) -> None:
    """A rank's task that fails (module-level: a pool pickles it by reference)."""
    raise ValueError(f"raised on purpose by verify's refusals section on rank {rank}")


def _broken_pool():
    """A pool whose task raised is broken: the next run must say so, not run."""
    from zero.ranks.launch import RankError
    from zero.ranks.local import WorkerPool

    with WorkerPool(1, timeout_s=60) as pool:
        try:
            pool.run(raise_on_purpose)
        except RankError:
            pass
        pool.run(raise_on_purpose)


def _unpicklable(rank: int, world_size: int):
    return lambda: None  # a rank's result must pickle to reach the parent


def _silent(rank: int, world_size: int) -> None:
    os._exit(3)  # no result, no traceback: the parent must still name the rank


def _slow(rank: int, world_size: int) -> None:
    time.sleep(60)


def _cuda_pool():
    from zero.ranks.local import WorkerPool

    WorkerPool(1, device="cuda", timeout_s=60).close()


def _env(**kw) -> dict:
    return {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "1", **kw}


def ranks_rows() -> list[Refusal]:
    """zero/ranks' checks of a world's arguments and of a launcher's environment, and what a
    rank that fails makes the parent raise: it raised, its result does not pickle, it exited
    silently, it outlived its deadline, it could not start (one forked rank each)."""
    from zero.ranks.launch import (
        LaunchEnvError,
        RankError,
        check_launch_env,
        check_timeout,
        visible_gpus,
    )
    from zero.ranks.launch import resolve_device as where
    from zero.ranks.local import PoolBrokenError, spawn

    rows = [
        ("ranks/launch", "an infinite timeout", lambda: check_timeout(math.inf), ValueError,
         "timeout_s=inf is not allowed: expected a finite number of seconds"),
        ("ranks/launch", "an unknown backend", lambda: where("mpi", None), ValueError,
         "backend='mpi' is not allowed"),
        ("ranks/launch", "an unknown device", lambda: where("gloo", "tpu"), ValueError,
         "device='tpu' is not allowed"),
        ("ranks/launch", "NCCL on the CPU", lambda: where("nccl", "cpu"), ValueError,
         "device='cpu' is not allowed: expected 'cuda' with backend='nccl'"),
        ("ranks/launch", "a world of no ranks", lambda: spawn(raise_on_purpose, 0), ValueError,
         "world_size=0 is not allowed: expected an integer >= 1"),
        ("ranks/local", "a negative deadline",
         lambda: spawn(raise_on_purpose, 1, deadline_s=-1.0), ValueError,
         "deadline_s=-1.0 is not allowed"),
        ("ranks/launch", "no launcher variables", lambda: check_launch_env({}), LaunchEnvError,
         "init_from_env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"),
        ("ranks/launch", "a world size that is no number",
         lambda: check_launch_env(_env(WORLD_SIZE="two")), LaunchEnvError,
         "WORLD_SIZE='two': must be an integer >= 1"),
        ("ranks/launch", "a port beyond 65535",
         lambda: check_launch_env(_env(MASTER_PORT="70000")), LaunchEnvError,
         "MASTER_PORT='70000': must be an integer >= 1 and <= 65535"),
        ("ranks/launch", "a rank beyond the world",
         lambda: check_launch_env(_env(RANK="2", WORLD_SIZE="2")), LaunchEnvError,
         "RANK='2': must be below WORLD_SIZE='2'"),
        ("ranks/launch", "stale launcher variables",
         lambda: check_launch_env(_env(WORLD_SIZE="2")), LaunchEnvError,
         "are set but TORCHELASTIC_RUN_ID and LOCAL_RANK are not"),
        ("ranks/local", "a rank that raises", lambda: spawn(raise_on_purpose, 1, timeout_s=60),
         RankError, "rank 0 failed:"),
        ("ranks/local", "a pool used after a rank raised", _broken_pool, PoolBrokenError,
         "is broken (RankError in raise_on_purpose); make a new pool"),
        ("ranks/local", "a rank's result that does not pickle",
         lambda: spawn(_unpicklable, 1, timeout_s=60), RankError, "pickle"),
        ("ranks/local", "a rank that exits without a word", lambda: spawn(_silent, 1, timeout_s=60),
         RankError, "rank 0: its process ended without reporting: exit code 3"),
        ("ranks/local", "a rank past its deadline",
         lambda: spawn(_slow, 1, timeout_s=60, deadline_s=0.5), TimeoutError,
         "spawn: ranks [0] of 1 did not report within 0.5 s; all ranks were killed"),
    ]  # fmt: skip
    if visible_gpus() == 0:  # where there is a GPU, a pool on it starts
        rows.append(("ranks/launch", "a pool on CUDA without a GPU", _cuda_pool, RankError,
                     "device='cuda' is not allowed: expected 'cpu' here"))  # fmt: skip
    return [Refusal(f"{mod}: {what}", mod, make, err, says) for mod, what, make, err, says in rows]


def node_rows() -> list[Refusal]:
    """The node layout (zero/ranks/nodes.py) and the block quantizer (reference/quantize.py):
    each refusal names the field, its value and what is allowed."""
    import numpy as np

    from reference.quantize import quantize
    from zero.common.traffic import link_bytes
    from zero.ranks.nodes import check_rows, resolve
    from zero.stages import hsdp

    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    rows = [
        ("ranks/nodes", "ranks per node not dividing the world",
         lambda: resolve(3, rank=0, world_size=4, env={}), ValueError,
         "ranks_per_node=3: must divide the world size 4"),
        ("ranks/nodes", "a layout that differs between ranks",
         lambda: check_rows([[0, 2, 0], [1, 1, 1]]), ValueError,
         "ranks_per_node: rank 1 has 1, rank 0 has 2"),
        ("ranks/nodes", "a rank not numbered node-major",
         lambda: check_rows([[0, 2, 0], [1, 2, 1]]), ValueError,
         "node: rank 1 reports node 1, but ranks are node-major"),
        ("ranks/nodes", "a config that disagrees with torchrun",
         lambda: resolve(4, rank=0, world_size=4, env=torchrun), ValueError,
         "ranks_per_node=4: under torchrun the launcher sets it (LOCAL_WORLD_SIZE=2)"),
        ("common/traffic", "a collective with no link model",
         lambda: link_bytes("gather", 8, (0, 1), 0), ValueError, "op='gather': no link model"),
        ("stages/hsdp", "a group size not dividing the world",
         lambda: hsdp.check(ZeroConfig(stage=2, shard_group_size=4), 6, None), ValueError,
         "shard_group_size=4: must divide the world size N = 6 (groups of G consecutive ranks); "
         "allowed here: [1, 2] or None"),
        ("reference/quantize", "a width the quantizer has no grid for",
         lambda: quantize(np.ones(8, np.float32), block=4, bits=5), ValueError,
         "bits=5: allowed are (8, 4)"),
    ]  # fmt: skip
    return [Refusal(f"{mod}: {what}", mod, make, err, says) for mod, what, make, err, says in rows]


def _dropped_step():
    from zero.common.traffic import CommCounter

    c = CommCounter(keep_steps=1)
    c.add(op="all_reduce", phase="grad", kind="model", unit=0, elements=1, padding=0, nbytes=4)
    c.step = 2  # step 0's records fall out of the window
    c.of_step(0)


def common_rows() -> list[Refusal]:
    """zero/common's memory model and traffic counter: their arguments and queries."""
    from zero.common.memory import checkpoint_bytes, model_state_breakdown
    from zero.common.traffic import CommCounter

    acts = dict(layers=2, tokens=4, hidden=8)
    state = dict(num_params=10, world_size=2, stage=1)
    rows = [
        ("common/memory", "P_a without model parallelism",
         lambda: checkpoint_bytes(**acts, partitioned=True), ValueError,
         "partitioned=True is not allowed: expected False when mp=1"),
        ("common/memory", "partitioned a string",
         lambda: checkpoint_bytes(**acts, mp=2, partitioned="yes"), ValueError,
         "partitioned='yes' is not allowed: expected True or False"),
        ("common/memory", "negative layers", lambda: checkpoint_bytes(**{**acts, "layers": -1}),
         ValueError, "layers=-1 is not allowed: expected an integer >= 0"),
        ("common/memory", "stage 4", lambda: model_state_breakdown(**{**state, "stage": 4}),
         ValueError, "stage=4 is not allowed: expected one of 0, 1, 2, 3"),
        ("common/memory", "negative bytes per parameter",
         lambda: model_state_breakdown(**state, param_bytes=-2), ValueError,
         "param_bytes=-2 is not allowed: expected a finite number >= 0"),
        ("common/memory", "deterministic a string",
         lambda: model_state_breakdown(**state, deterministic="yes"), ValueError,
         "deterministic='yes' is not allowed: expected True or False"),
        ("common/traffic", "a window of no steps", lambda: CommCounter(keep_steps=0), ValueError,
         "keep_steps=0: must be None or an integer >= 1"),
        ("common/traffic", "a step the window dropped", _dropped_step, ValueError,
         "step=0: its traffic records were dropped"),
    ]  # fmt: skip
    return [Refusal(f"{mod}: {what}", mod, make, err, says) for mod, what, make, err, says in rows]


def here_rows() -> list[Refusal]:
    return config_rows() + model_rows() + common_rows() + ranks_rows() + node_rows()


def row_counts() -> dict[str, int]:
    """Rows per place (builds the rows, runs none)."""
    from . import damage as refusal_damage
    from . import ranks as refusal_ranks

    where = Path(tempfile.gettempdir()) / "zero-refusals-listing"  # named, never created
    return {
        "here": len(here_rows()),
        "on N=1 ranks": len(refusal_ranks.rank_rows(0, 1, where)),
        "on N=2 ranks": len(refusal_ranks.rank_rows(0, 2, where)),
        "on damaged checkpoints": len(refusal_damage.damage_rows(where)),
    }


def count_line() -> str:
    """`python -m verify --list`'s line for this section."""
    counts = row_counts()
    where = ", ".join(f"{v} {k}" for k, v in counts.items())
    return f"refusals: {sum(counts.values())} rows ({where})"


def on_pool(n: int, directory: Path, timeout_s: float) -> list[dict]:
    """The rows of world n (verify/refusals/ranks.py) on a local pool of n; a failing row for
    the world when the pool itself raised (verify.checks.report.guarded)."""
    from zero.ranks.local import get_pool

    from .ranks import rank_rows, run_rows

    rows = rank_rows(0, n, directory)

    def run() -> list[dict]:
        per_rank = get_pool(n).run(run_rows, str(directory), timeout_s=timeout_s)
        return [result(r, [out[r.name] for out in per_rank]) for r in rows]

    def failed(row: dict) -> list[dict]:
        where = {"row": f"N={n} ranks", "module": "-", "where": f"N={n}"}
        return [{**where, "message": f"raised {row['error']}", **row}]

    return guarded(f"N={n} ranks", run, wrap=failed)


def run_section(*, timeout_s: float, say, world_sizes=None, directory=None) -> list[dict]:
    """Every row: here, on the pools of N = 1 and 2 (those of world_sizes, when given), then
    the damaged copies of the checkpoints the pools saved. `directory` receives those
    checkpoints (a temporary directory, removed afterwards, when None)."""
    from zero.ranks.launch import under_torchrun

    say("refusals (bad input and damaged checkpoints: each must raise the named error, saying")
    say("          the named text; rows and their texts in verify/refusals/):")
    if under_torchrun():
        say("  (refusals skipped under torchrun: its ranks run on local pools; run")
        say("   python -m verify --quick without torchrun for them)")
        return []
    with tempfile.TemporaryDirectory(prefix="zero-refusals-") as tmp:
        base = Path(directory) if directory is not None else Path(tmp)
        rows = judge_here(here_rows())
        for n in (1, 2):
            if world_sizes is None or n in world_sizes:
                rows += on_pool(n, base, timeout_s)
        from .damage import damage_rows

        rows += judge_here(damage_rows(base))
    summarize(rows, say)
    return rows


def summarize(rows: list[dict], say) -> None:
    """A line per library module (rows passed of rows), and each failing row."""
    modules: dict[str, list[bool]] = {}
    for r in rows:
        modules.setdefault(r["module"], []).append(r["passed"])
    per = [f"{m} {sum(v)}/{len(v)}" for m, v in sorted(modules.items())]
    for i in range(0, len(per), 6):
        say("  " + ", ".join(per[i : i + 6]))
    for r in rows:
        if not r["passed"]:
            say(f"  {r['row']:<60} FAIL {r['message']}")
