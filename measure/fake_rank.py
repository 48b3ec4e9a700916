"""One process as rank r of an N-rank job: the fake world, for measuring what one rank holds.

    python -m measure.fake_rank --params 7.5e9 --world-size 64 --rank 0 --stage 3 --steps 1

The process joins a fake process group (torch's FakeStore: collectives return at once and keep
shapes; values are meaningless), builds the GPT of `gpt_config_for(params)` on the meta device,
and lets the engine materialise only this rank's shards, unit by unit, with initialisation skipped
(zeros). Then it runs real steps. Memory is *measured outside the engine*: the process's resident
set (RSS, from /proc/self/statm) before the model is built, after construction, and after each
step, beside the analytic model of zero/common/memory.py and the engine's own accounting. Peaks (the
largest unit during construction, a gathered unit and activations during a step) are reported
apart from the quiescent point after a step. With ``--mp N_m`` the world is an N_d × N_m mesh and
the rank builds its tensor-parallel slice ([Note: simulated MP rank]).

Legend: Ψ parameters of the model, N = N_d world size, K = 12 (mixed-precision Adam).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields

from zero.common import cli

from .resident import MemoryProbe, mem_available_bytes, peak_rss_bytes, rss_bytes

__all__ = [
    "SimulateConfig",
    "estimate_peak_bytes",
    "measure_rank",
    "peak_rss_bytes",
    "rss_bytes",
    "simulate_rank",
]

TRANSIENT_BYTES_PER_UNIT_ELEMENT = 24
"""[Note: transient bound] Bytes per element of the largest unit that a rank holds on top of its
model states at its peak. Construction holds one unit's fp32 start values twice (the flat buffer
and the per-parameter values, 8 B) and its compute-dtype working copy (2 B); a stage-3 step holds
up to two gathered units and the root (2 B each), a unit's full-size gradient (2 B), the receive
buffers of up to two reductions in flight (2 B each) and the parameters' .grad (2 B), about 16 B.
24 B leaves a margin: the 7.5B rank of Figure 1 peaked 3.0 GB above its model states, 19.5 B
times its largest unit (the root, 154M elements). Used only to decide whether a rank fits."""

RUNTIME_BYTES = 256 * 1024**2
"""What a first step costs whatever the model (kernel workspaces, autograd's thread: about 31 MB
measured) plus activations at sequence 64 and batch 1, with room to spare."""

HEADROOM_BYTES = 2 * 1024**3
"""Memory left to everything else on the machine when a large simulated rank starts."""


def _gpt(params: float, *, seq: int, vocab_size: int, shape: dict | None = None):
    """The GPT of `gpt_config_for(params)`, or of `shape` (n_layer, n_embd, n_head) when given."""
    from zero.workloads.models import GPTConfig, gpt_config_for, gpt_num_params

    if shape:
        cfg = GPTConfig(vocab_size=vocab_size, block_size=max(seq, 16), **shape)
    else:
        cfg, _ = gpt_config_for(params, vocab_size=vocab_size)
        cfg = type(cfg)(**{**cfg.__dict__, "block_size": max(seq, 16)})
    return cfg, gpt_num_params(cfg)  # arithmetic: a 1e15 model is never built to be counted


BLOCK_TENSORS, ROOT_TENSORS = 12, 5
"""Parameter tensors of a GPT block (two layer norms, attention and MLP, weights and biases) and
at most of its root unit (the embeddings, the last layer norm, an untied head): each starts at an
aligned offset, so each adds at most ALIGN - 1 elements of gap to its unit's flat buffer."""


def padded_unit_numel(numel: int, tensors: int, *, chunk: int, world_size: int) -> int:
    """An upper bound of the flat buffer N·L of a unit of `numel` parameters in `tensors`
    tensors (reference/layout.py): offsets aligned to ALIGN, the extent rounded up to whole
    chunks C, then to N·L with L a multiple of C. At a large N this is N·C, whatever the unit:
    every rank holds at least one chunk of every unit, and a gathered unit is N of them."""
    from reference.layout import ALIGN

    chunks = max(1, math.ceil((numel + tensors * (ALIGN - 1)) / chunk))
    return world_size * math.ceil(chunks / world_size) * chunk


def estimate_peak_bytes(
    *,
    params: float,
    world_size: int,
    stage: int,
    seq: int = 64,
    vocab_size: int = 50257,
    shape: dict | None = None,
    options: dict | None = None,
) -> dict:
    """The analytic model states of one rank (the paper's formula on Ψ: model_states) and an
    upper estimate of its peak, in bytes.

    Peak = model states of the padded units (zero.common.memory, the paper's configuration)
    + TRANSIENT_BYTES_PER_UNIT_ELEMENT × the largest padded unit ([Note: transient bound])
    + RUNTIME_BYTES. Pure arithmetic on the model's shape: nothing is allocated. The padding
    counts: each unit is padded to N·L elements (padded_unit_numel), which at a large world
    size is N·C for every unit, far above its parameters (2M parameters at N = 10^6 are
    padded to 12·10^9 elements, and a rank gathers 4·10^9 of them at once). `options` (further
    ZeroConfig fields) may set the chunk C.
    """
    from zero.common.memory import model_state_breakdown
    from zero.config import ZeroConfig

    chunk = (options or {}).get("chunk", ZeroConfig.__dataclass_fields__["chunk"].default)
    cfg, count = _gpt(params, seq=seq, vocab_size=vocab_size, shape=shape)
    h = cfg.n_embd
    block = 12 * h * h + 13 * h
    root = count - cfg.n_layer * block
    pad = dict(chunk=chunk, world_size=world_size)
    padded_block = padded_unit_numel(block, BLOCK_TENSORS, **pad)
    padded_root = padded_unit_numel(root, ROOT_TENSORS, **pad)
    padded = cfg.n_layer * padded_block + padded_root
    states = model_state_breakdown(num_params=count, world_size=world_size, stage=stage).total
    held = model_state_breakdown(num_params=padded, world_size=world_size, stage=stage).total
    largest = max(padded_block, padded_root)
    peak = held + TRANSIENT_BYTES_PER_UNIT_ELEMENT * largest + RUNTIME_BYTES
    return {
        "num_params": count,
        "model_states": states,
        "padded_params": padded,
        "padded_model_states": held,
        "largest_unit": largest,
        "chunk": chunk,
        "peak": peak,
    }


def refuse_unless_fits(est: dict, *, params: float, world_size: int, device: str) -> None:
    """A ValueError naming params (and world_size, where the padding of N ranks is what does not
    fit) unless a rank of estimate `est` fits here now (fits_here)."""
    ok, reason = fits_here(est, device=device)
    if ok:
        return
    count, padded = est["num_params"], est["padded_params"]
    if padded > 2 * count:  # the world's padding, not the model, is what is large
        raise ValueError(
            f"params={params:g}, world_size={world_size}: {reason} ({count:,} parameters, "
            f"padded to {padded:,} elements: every unit is at least N·C = {world_size:,} × "
            f"{est['chunk']} elements, the largest {est['largest_unit']:,}); allowed are ranks "
            "that fit (a smaller world_size), or pass --force"
        )
    raise ValueError(
        f"params={params:g}: {reason} ({count:,} parameters); allowed are ranks that fit, or "
        "pass --force"
    )


FIXED_OPTIONS = ("stage", "precision", "reduce_dtype", "optimizer", "micro_batches", "units",
                 "nonfinite", "groups", "group_of", "scaler")  # fmt: skip
"""ZeroConfig fields a simulated rank sets itself (the paper's configuration: bf16, Adam; the
stage its own option; units the model's blocks) or that JSON cannot give: not in `options`."""


def _shown(value) -> str:
    """A value as the command line gave it (JSON), else its repr."""
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    except (TypeError, ValueError):
        return repr(value)


def zero_config(*, stage: int, world_size: int, options: dict | None, units=()):
    """The ZeroConfig of a simulated rank: the paper's configuration and `options`."""
    from zero.config import ZeroConfig

    return ZeroConfig(
        stage=stage,
        precision="bf16",
        reduce_dtype="bf16",
        optimizer="adam",
        micro_batches=world_size,
        units=units,
        nonfinite="skip",
        # the gradient buffers exist from construction on every device, so that the resident
        # set after construction is the paper's model states (release_grads would allocate them
        # in the first step only, on CUDA by default)
        **{"release_grads": False, **(options or {})},
    )


def check_options(options, *, stage: int, world_size: int, mp: int) -> None:
    """`options` is None or a dict of further ZeroConfig fields that make a valid config of
    this rank (checked before anything is built); else a ValueError naming options."""
    if options is None:
        return
    from zero import build
    from zero.config import ZeroConfig

    allowed = [f for f in ZeroConfig.__dataclass_fields__ if f not in FIXED_OPTIONS]
    head = f"options={_shown(options)}"
    if not isinstance(options, dict):
        raise ValueError(
            f"{head}: not a JSON object; allowed is an object of further ZeroConfig fields, "
            f"of {', '.join(allowed)}"
        )
    for key in options:
        if key not in allowed:
            why = (
                f"{key!r} is set by the simulated rank" + (f" (--{key})" if key == "stage" else "")
                if key in FIXED_OPTIONS
                else f"{key!r} is not a ZeroConfig field"
            )
            raise ValueError(f"{head}: {why}; allowed keys are {', '.join(allowed)}")
    try:
        zcfg = zero_config(stage=stage, world_size=world_size, options=options)
        build.check_config(zcfg, world_size)
    except ValueError as exc:
        raise ValueError(f"{head}: {' '.join(str(exc).split())}") from None
    if zcfg.partition_activations and mp == 1:
        raise ValueError(f"{head}: partition_activations=True needs model parallelism (mp > 1)")


DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


def check_device(device) -> None:
    """'cpu', or 'cuda[:i]' where this process has CUDA device i; else a ValueError naming
    device (checked before anything is built: torch would fail in its first CUDA call)."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise ValueError(f"device={device!r}: allowed are 'cpu' and 'cuda[:i]'")
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
        raise ValueError(
            f"device={device!r}: this process has no CUDA device (torch {torch.__version__}, "
            f"built {built}); allowed here is 'cpu'"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        raise ValueError(
            f"device={device!r}: this process has {count} CUDA device(s); allowed are 'cpu' "
            f"and 'cuda:0' .. 'cuda:{count - 1}'"
        )


def _meta_model(cfg, *, world_size: int, mp: int, deterministic: bool = True):
    """(model on meta, ZeRO's group, MPContext or None) for this rank.

    [Note: simulated MP rank] With N_m = mp > 1 the process is global rank r of a fake
    world_size·mp mesh: it creates every group of zero.mp.Mesh (as each rank of a real job
    does), builds only its TPGPT slice (meta: the engine materialises it unit by unit) and runs
    ZeRO in its DP group. The MP collectives and P_a's all-gathers return at once with the right
    shapes, so what the rank holds is what a real rank (d, m) holds; their traffic is counted."""
    from zero.workloads.models import GPT

    if mp == 1:
        return GPT(cfg, device="meta"), None, None
    from zero.collectives import CommCounter
    from zero.mp import TPGPT, Mesh, MPContext

    groups = Mesh(dp=world_size, mp=mp).groups()
    ctx = MPContext.of(groups.mp_group, counter=CommCounter(), deterministic=deterministic)
    return TPGPT(cfg, ctx), groups.dp_group, ctx


def fits_here(estimate: dict, *, device: str = "cpu") -> tuple[bool, str]:
    """Whether a rank with this estimated peak fits now, and the reason either way."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        ok = estimate["peak"] <= free
        what = f"{free / 1e9:.1f} GB free of {total / 1e9:.1f} GB on {torch.cuda.get_device_name()}"
    else:
        avail = mem_available_bytes()
        if avail is None:
            return False, "MemAvailable unknown (no /proc/meminfo): not started"
        ok = estimate["peak"] + HEADROOM_BYTES <= avail
        what = f"MemAvailable {avail / 1e9:.1f} GB, keeping {HEADROOM_BYTES / 1e9:.1f} GB headroom"
    verdict = "fits" if ok else "does not fit"
    return ok, f"estimated peak {estimate['peak'] / 1e9:.2f} GB {verdict}: {what}"


@dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    """One simulated rank; every field is an option of `python -m measure.fake_rank` and an
    argument of simulate_rank and measure_rank."""

    params: float = 7.5e9
    """Ψ requested: the GPT is zero.workloads.models.gpt_config_for(params) unless `shape` is
    given."""
    world_size: int = 64
    """N: the fake world's size."""
    rank: int = 0
    """Which rank of the N this process is."""
    stage: int = 3
    """ZeRO stage 0-3."""
    steps: int = 1
    """Real optimizer steps after construction."""
    seq: int = 64
    """Tokens per sequence."""
    batch: int = 1
    """Sequences per micro-batch."""
    vocab_size: int = 50257
    """Vocabulary of the GPT."""
    device: str = "cpu"
    """'cpu', or 'cuda[:i]' (allocator bytes instead of RSS)."""
    shape: dict | None = None
    """JSON {"n_layer", "n_embd", "n_head"} replacing gpt_config_for(params)."""
    options: dict | None = None
    """JSON of further ZeroConfig fields (e.g. {"activation_checkpointing": true})."""
    mp: int = 1
    """N_m: model-parallel degree. Above 1 the fake world has world_size·mp ranks, `rank` is a
    global rank of that mesh (zero.mp.Mesh: rank = d·N_m + m) and the rank builds its TPGPT
    slice; ZeRO runs in its DP group of N_d = world_size ranks ([Note: simulated MP rank])."""

    def __post_init__(self):
        for name in ("world_size", "steps", "seq", "batch", "vocab_size", "rank", "stage", "mp"):
            if isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed are integers")
        for name in ("world_size", "steps", "seq", "batch", "vocab_size", "mp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: allowed are integers >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size * self.mp):
            raise ValueError(f"rank={self.rank!r}: allowed are 0 .. world_size·mp - 1")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={self.stage!r}: allowed are 0, 1, 2, 3")
        if self.shape is None and not 0 < self.params < float("inf"):  # a shape makes it unused
            raise ValueError(
                f"params={self.params!r}: allowed are finite counts > 0 (or give shape)"
            )
        if self.shape is not None and (
            set(self.shape) != {"n_layer", "n_embd", "n_head"}
            or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1
                for v in self.shape.values()
            )
        ):
            raise ValueError(
                f"shape={self.shape!r}: allowed is {{'n_layer', 'n_embd', 'n_head'}}, integers >= 1"
            )
        check_device(self.device)
        check_options(self.options, stage=self.stage, world_size=self.world_size, mp=self.mp)


def simulate_rank(
    *,
    params: float,
    world_size: int,
    rank: int,
    stage: int,
    steps: int,
    seq: int = 64,
    batch: int = 1,
    vocab_size: int = 50257,
    device: str = "cpu",
    shape: dict | None = None,
    options: dict | None = None,
    mp: int = 1,
) -> dict:
    """Build and step rank `rank` of a fake world; returns measurements (bytes).

    `shape` ({"n_layer", "n_embd", "n_head"}) replaces `gpt_config_for(params)`; `options` holds
    further ZeroConfig fields (the ZeRO-R options activation_checkpointing, offload_activations,
    bucket_elements, contiguous_memory; chunk). Each step is timed (collectives on the fake group
    cost nothing, so the time is this rank's compute, copies and optimizer).

    Measured outside the engine with measure.resident.MemoryProbe (RSS on CPU, allocator bytes on
    CUDA), the baseline taken after the fake process group exists and before the model is
    built. Samples: after construction (peak: construction) and after each step (peak: that
    step, the peak reset before it).
    """
    check_device(device)  # before the process group and the model: one line naming it
    check_options(options, stage=stage, world_size=world_size, mp=mp)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size * mp)
    from zero.common.memory import model_state_breakdown
    from zero.engine import ZeroEngine

    cfg, count = _gpt(params, seq=seq, vocab_size=vocab_size, shape=shape)
    # the meta model before the baseline: it holds no tensor memory, but building the first one
    # costs a process tens of MB of one-time setup that is no engine's (the rank's count used
    # to build one before the baseline too)
    det = (options or {}).get("deterministic", True)  # the MP sums' mode is the engine's
    model, group, ctx = _meta_model(cfg, world_size=world_size, mp=mp, deterministic=det)
    held = sum(p.numel() for p in model.parameters())  # Ψ_m: this rank's slice (Ψ at N_m = 1)
    probe = MemoryProbe(device=device)
    zcfg = zero_config(
        stage=stage, world_size=world_size, options=options, units=tuple(model.unit_names())
    )
    t0 = time.perf_counter()
    engine = ZeroEngine(model, zcfg, group=group, device=device, init_seed=None, mp=ctx)
    built = probe.sample("after construction")
    padded = sum(u.part.padded_numel for u in engine.units)
    analytic = model_state_breakdown(num_params=padded, world_size=world_size, stage=stage)
    tokens = torch.zeros((batch, seq), dtype=torch.long, device=device)
    after, step_seconds = [], []
    for i in range(steps):
        probe.reset_peak()
        t_step = time.perf_counter()
        for _k in range(zcfg.micro_batches // world_size):
            _, loss = engine(tokens, tokens)
            engine.backward(loss)
        engine.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))
        step_seconds.append(time.perf_counter() - t_step)
        del loss
        after.append(probe.sample(f"after step {i + 1}"))
    report = engine.memory_report()
    # Activation checkpoints kept in host memory by offload_activations, per micro-step: all of
    # a micro-step's checkpoints are held at once, from their forward to their recomputation.
    # (the counter's totals: its records keep only the last steps, [Note: bounded traffic
    # records] in zero/collectives.py)
    offloaded = sum(  # plain checkpoints (activation_down) or P_a+cpu's parts (p_a_down)
        engine.counter.total("offload", phase=ph)["nbytes"]
        for ph in ("activation_down", "p_a_down")
    )
    return {
        "config": {
            "params_requested": params,
            "num_params": count,
            "world_size": world_size,
            "rank": rank,
            "stage": stage,
            "steps": steps,
            "seq": seq,
            "batch": batch,
            "layers": cfg.n_layer,
            "hidden": cfg.n_embd,
            "vocab_size": vocab_size,
            "precision": "bf16",
            "reduce_dtype": "bf16",
            "optimizer": "adam",
            "device": device,
            "n_head": cfg.n_head,
            "options": dict(options or {}),
            "mp": mp,
            "slice_params": held,
        },
        "measurement": probe.describe(),
        "peak_resettable": probe.peak_resettable,
        "full_fp32_weights_bytes": 4 * count,
        "padded_params": padded,
        "rss_baseline": probe.baseline,
        "samples": probe.samples,
        # The quiescent bytes above the baseline (RSS after gc + malloc_trim on CPU).
        "rss_after_construction": built["bytes"],
        "rss_after_steps": [a["bytes"] for a in after],
        "construction_peak": built["peak"],
        "step_peak": max((a["peak"] for a in after), default=0),
        "rss_peak": max([built["peak"], *(a["peak"] for a in after)]),
        "engine_report": report,
        "engine_model_states": sum(report[k] for k in ("params", "grads", "master", "optimizer")),
        "analytic": analytic.to_dict(),
        "analytic_model_states": analytic.total,
        "analytic_paper_formula": model_state_breakdown(
            num_params=held, world_size=world_size, stage=stage
        ).total,
        "step_seconds": step_seconds,
        "mp_traffic": _mp_traffic(engine.counter),
        "activation_host_bytes": offloaded // max(1, steps * zcfg.micro_batches // world_size),
        "seconds": time.perf_counter() - t0,
    }


def _mp_traffic(counter) -> dict[str, int]:
    """Elements sent per MP phase over the whole run (kind "mp": [Note: mp traffic kind])."""
    out: dict[str, int] = {}
    for (kind, _op, phase), row in counter.totals.items():
        if kind == "mp":
            out[phase] = out.get(phase, 0) + row[1]
    return out


def measure_rank(
    *, timeout_s: float = 1800, check_fits: bool = True, env: dict | None = None, **kwargs
) -> dict:
    """simulate_rank in a fresh process (its own baseline and peak, and the fake group of its
    own world size), or a skip when it would not fit the machine now.

    Returns {"ran": True, "result": simulate_rank's dict} or {"ran": False, "reason": ...}.
    kwargs are simulate_rank's; `env` adds environment variables for the child (e.g. malloc's
    settings). The child is `python -m measure.fake_rank`; its record comes back through a
    temporary JSON file.
    """
    device = kwargs.get("device", "cpu")
    check_device(device)  # fits_here asks the device
    check_options(
        kwargs.get("options"), stage=kwargs["stage"], world_size=kwargs["world_size"],
        mp=kwargs.get("mp", 1),
    )  # fmt: skip
    if check_fits:
        est = estimate_peak_bytes(
            params=kwargs["params"],
            world_size=kwargs["world_size"],
            stage=kwargs["stage"],
            seq=kwargs.get("seq", 64),
            vocab_size=kwargs.get("vocab_size", 50257),
            shape=kwargs.get("shape"),
            options=kwargs.get("options"),
        )
        ok, reason = fits_here(est, device=device)
        if not ok:
            return {"ran": False, "reason": reason, "estimate": est}
    flags = {f.name: "--" + f.name.replace("_", "-") for f in fields(SimulateConfig)}
    unknown = set(kwargs) - set(flags)
    if unknown:
        raise ValueError(f"measure_rank: unknown argument(s) {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="zero-simulate-") as tmp:
        path = os.path.join(tmp, "rank.json")
        # --force: the fit was decided above (or waived by check_fits=False)
        argv = [sys.executable, "-m", "measure.fake_rank", "--json", path, "--quiet", "--force"]
        for key, value in kwargs.items():
            if value is not None:
                argv += [flags[key], json.dumps(value) if isinstance(value, dict) else str(value)]
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=None if not env else {**os.environ, **env},
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"simulated rank {kwargs} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
            )
        with open(path) as f:
            return {"ran": True, "result": json.load(f)["result"]}


def main(argv=None) -> int:
    p = cli.new_parser("python -m measure.fake_rank", __doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the record (zero.common.results) here")
    p.add_argument("--quiet", action="store_true", help="print nothing (for measure_rank)")
    p.add_argument(
        "--force",
        action="store_true",
        help="build the rank even when its estimated peak exceeds the memory available",
    )
    cfg, a = cli.parse(SimulateConfig, argv, parser=p, choices={"stage": (0, 1, 2, 3)})
    if a.json is not None:
        cli.check_writable("json", a.json, file=True)
    if not a.force:  # before anything is built: a 1e15 model would take minutes, then fail
        est = estimate_peak_bytes(
            params=cfg.params, world_size=cfg.world_size, stage=cfg.stage, seq=cfg.seq,
            vocab_size=cfg.vocab_size, shape=cfg.shape, options=cfg.options,
        )  # fmt: skip
        refuse_unless_fits(est, params=cfg.params, world_size=cfg.world_size, device=cfg.device)
    out = simulate_rank(**asdict(cfg))
    if not a.quiet:
        gb = 1e9
        print(
            f"GPT {out['config']['num_params'] / 1e9:.2f}B params ({out['config']['layers']} "
            f"layers, hidden {out['config']['hidden']}); whole fp32 weights "
            f"{out['full_fp32_weights_bytes'] / gb:.1f} GB"
        )
        print(
            f"rank {a.rank} of {a.world_size}, stage {a.stage}: analytic model states "
            f"{out['analytic_model_states'] / gb:.3f} GB; engine accounting "
            f"{out['engine_model_states'] / gb:.3f} GB; measured ({out['measurement']}) after "
            f"construction {out['rss_after_construction'] / gb:.3f} GB, after step(s) "
            f"{[round(x / gb, 3) for x in out['rss_after_steps']]} GB; peak "
            f"{out['rss_peak'] / gb:.3f} GB (construction {out['construction_peak'] / gb:.3f}, "
            f"step {out['step_peak'] / gb:.3f})"
        )
    if a.json:
        from zero.common.results import make_record, provenance, write_json

        write_json(
            a.json,
            make_record(
                config=out["config"], result=out, kind="simulate.rank", provenance=provenance()
            ),
        )
    return 0


if __name__ == "__main__":
    cli.run(main, "python -m measure.fake_rank")
