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
the rank builds its tensor-parallel slice ([Note: simulated MP rank]). The configuration and its
checks are measure/parts/fake_rank_config.py's, the peak estimate
measure/parts/fake_rank_estimate.py's (both importable from here).

Legend: Ψ parameters of the model, N = N_d world size, K = 12 (mixed-precision Adam).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields

from zero.common import cli

from .parts.fake_rank_config import SimulateConfig, check_device, check_options, zero_config
from .parts.fake_rank_estimate import estimate_peak_bytes, gpt_for
from .parts.fake_rank_estimate import gpt_for as _gpt  # noqa: F401  (importable as before)
from .resident import MemoryProbe, mem_available_bytes, peak_rss_bytes, rss_bytes

__all__ = [
    "SimulateConfig",
    "estimate_peak_bytes",
    "measure_rank",
    "peak_rss_bytes",
    "rss_bytes",
    "simulate_rank",
]

HEADROOM_BYTES = 2 * 1024**3
"""Memory left to everything else on the machine when a large simulated rank starts."""


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
    _join_fake_world(rank=rank, size=world_size * mp, device=device)
    from zero.engine import ZeroEngine

    cfg, count = gpt_for(params, seq=seq, vocab_size=vocab_size, shape=shape)
    # the meta model before the baseline: it holds no tensor memory, but building the first one
    # costs a process tens of MB of one-time setup that is no engine's (the rank's count used
    # to build one before the baseline too)
    det = (options or {}).get("deterministic", True)  # the MP sums' mode is the engine's
    model, group, ctx = _meta_model(cfg, world_size=world_size, mp=mp, deterministic=det)
    held = sum(p.numel() for p in model.parameters())  # Ψ_m: this rank's slice (Ψ at N_m = 1)
    probe = MemoryProbe(device=device)
    units = tuple(model.unit_names())
    zcfg = zero_config(stage=stage, world_size=world_size, options=options, units=units)
    t0 = time.perf_counter()
    engine = ZeroEngine(model, zcfg, group=group, device=device, init_seed=None, mp=ctx)
    built = probe.sample("after construction")
    micro_steps = zcfg.micro_batches // world_size
    after, seconds = _run_steps(engine, probe, steps, micro_steps, (batch, seq), device)
    config = {
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
    }
    sizes = {"count": count, "held": held, "world_size": world_size, "stage": stage}
    return {"config": config, **_measured(engine, probe, built, after, seconds, t0=t0, **sizes)}


def _join_fake_world(*, rank: int, size: int, device: str) -> None:
    """This process as rank `rank` of a fake process group of `size` ranks (FakeStore), one
    thread, its CUDA device set where it has one."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)


def _run_steps(engine, probe, steps: int, micro_steps: int, shape: tuple, device: str):
    """`steps` optimizer steps of `micro_steps` micro-steps each on zero tokens of `shape`
    (B, T); (the probe's sample after each step, its peak reset before it; seconds per step)."""
    import torch

    tokens = torch.zeros(shape, dtype=torch.long, device=device)
    after, step_seconds = [], []
    for i in range(steps):
        probe.reset_peak()
        t_step = time.perf_counter()
        for _k in range(micro_steps):
            _, loss = engine(tokens, tokens)
            engine.backward(loss)
        engine.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))
        step_seconds.append(time.perf_counter() - t_step)
        del loss
        after.append(probe.sample(f"after step {i + 1}"))
    return after, step_seconds


def _measured(engine, probe, built: dict, after: list[dict], step_seconds: list[float], *,
              count: int, held: int, world_size: int, stage: int, t0: float) -> dict:  # fmt: skip
    """simulate_rank's measurements beside the engine's accounting and the analytic model
    states: of the padded units (analytic) and of the paper's formula on Ψ_m (held)."""
    from zero.common.memory import model_state_breakdown

    padded = sum(u.part.padded_numel for u in engine.units)
    analytic = model_state_breakdown(num_params=padded, world_size=world_size, stage=stage)
    report = engine.memory_report()
    # Activation checkpoints kept in host memory by offload_activations, per micro-step: all of
    # a micro-step's checkpoints are held at once, from their forward to their recomputation.
    # (the counter's totals: its records keep only the last steps, [Note: bounded traffic
    # records] in zero/collectives.py)
    offloaded = sum(  # plain checkpoints (activation_down) or P_a+cpu's parts (p_a_down)
        engine.counter.total("offload", phase=ph)["nbytes"]
        for ph in ("activation_down", "p_a_down")
    )
    micro_steps = len(step_seconds) * engine.config.micro_batches // world_size
    return {
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
        "activation_host_bytes": offloaded // max(1, micro_steps),
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
