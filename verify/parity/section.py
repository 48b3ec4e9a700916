"""Parity with plain PyTorch: the engine against the single-process torch loop, per model family.

verify/parity/anchors.py compares the reference with torch on the project's GPT; this section
compares
the *engine* with the textbook loop directly, on several families (FAMILIES: the MLP, the GPT, a
ResNet with BatchNorm, Hugging Face GPT-2 and Llama), at stages 0-3, N ∈ {1, 2, 4}, both modes,
fp32 and bf16. A cell (ParityCell) trains S steps of M micro-batches; before every step the plain
side (Plain) takes the engine's full state (gather_state: fp32 master, AdamW's moments, t; rank
0's buffers) and runs (loss_j / M).backward() over the same micro-batches, clip_grad_norm_ and
torch.optim.AdamW(foreach=False) (bf16: a bf16 copy for forward and backward, the fp32 master
for the optimizer). Lock-step, as the anchors argue: only one step from a common state has a
derivable bound (step_bounds' docstring derives each). Deterministic cells also hash the state
(state_digest): one digest per family and precision over every N and stage, and the Hugging
Face families' export and import (hf_leg.py) give the master's bits. How to run it:
docs/verification.md, "Parity with plain PyTorch".

Here: the families, the cells, running them and the report. One lock-step's plain side, bounds
and checks are verify/parity/lockstep.py (its names importable from here too).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine

from ..cells.cell import GROUPS, MODELS
from ..checks.expect import group_mismatch
from ..checks.harness import each_cell, state_digest
from .hf_leg import hf_leg
from .lockstep import (  # noqa: F401  (the lock-step's parts: importable from here)
    CHECKS,
    PLANTS,
    Plain,
    PlainStep,
    check_step,
    family_loss,
    step_bounds,
)


@dataclass(frozen=True, kw_only=True)
class Family:
    """A model family of the parity section: adding a family is one entry of FAMILIES."""

    build: Callable[[], torch.nn.Module]
    """A fresh model, the same bits in every process (seeded)."""
    batch: Callable[[int, int], tuple | dict]
    """batch(step, j): micro-batch j of a step, positional (a tuple) or keyword (a dict)."""
    clip_norm: float
    """Chosen between the plain loop's norms of the first steps, so that some steps clip and
    some do not (tests/distributed/test_verify_parity.py checks both happen)."""
    requires: tuple[str, ...] = ()
    """Importable modules the family needs; without one its cells are skipped with the reason."""
    units: str | tuple[str, ...] | None = None
    """ZeroConfig.units; None: the model's unit_names() where it has one, else "auto" (the
    repeated blocks: decoder layers, residual blocks)."""

    def missing(self) -> str | None:
        for name in self.requires:
            if importlib.util.find_spec(name) is None:
                return f"{name} is not installed (pip install -e '.[models]')"
        return None


def _ours(name: str, clip_norm: float) -> Family:
    """The project's own models (verify.cells.cell.MODELS) and their data, seed 0."""
    build, data = MODELS[name]
    cfg = build().cfg

    def batch(step: int, j: int):
        return data(cfg, seed=0, data_step=step, count=j + 1, batch_size=4)[j]

    return Family(build=build, batch=batch, clip_norm=clip_norm)


def _resnet():
    from zero.workloads.resnet import ResNet, ResNetConfig

    return ResNet(ResNetConfig(widths=(8, 16, 16), depth=1), seed=0)


def _images(step: int, j: int):
    """8 random 8×8 images; micro-batch j has its own mean, so batch statistics differ."""
    g = torch.Generator().manual_seed(1000 * step + j)
    return torch.randn(8, 1, 8, 8, generator=g) + 0.5 * j, torch.randint(0, 10, (8,), generator=g)


def _hf(kind: str):
    """A random-weight Hugging Face model from a config (no download); dropout off (its random
    stream is per process), eager attention."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "gpt2":
            cfg = GPT2Config(
                n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                attn_implementation="eager",
            )  # fmt: skip
            return GPT2LMHeadModel(cfg)
        cfg = LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
            attn_implementation="eager",
        )  # fmt: skip
        return LlamaForCausalLM(cfg)


def _tokens(step: int, j: int) -> dict:
    g = torch.Generator().manual_seed(7919 * step + j)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids}


LORA_CLIP = 0.064
"""The LoRA family's clip_norm: the plain loop's norms of its first four steps are 0.0655,
0.0610, 0.0618, 0.0699 (only the 2,048 adapter elements have gradients), so steps 0 and 3 clip
and 1 and 2 do not."""


def _lora():
    """The project's GPT with rank-2 LoRA adapters (zero/workloads/lora.py): every base weight
    frozen, only the adapters train (frozen parameters: docs/design.md §2)."""
    from zero.workloads.lora import add_lora

    model = MODELS["gpt"][0]()
    add_lora(model, 2)
    return model


FAMILIES: dict[str, Family] = {
    "mlp": _ours("mlp", clip_norm=1.5),
    "gpt": _ours("gpt", clip_norm=0.7),
    "resnet": Family(build=_resnet, batch=_images, clip_norm=1.25),
    "gpt2": Family(
        build=lambda: _hf("gpt2"), batch=_tokens, clip_norm=0.8, requires=("transformers",)
    ),
    "llama": Family(
        build=lambda: _hf("llama"), batch=_tokens, clip_norm=0.8, requires=("transformers",)
    ),
    "lora": Family(build=_lora, batch=_ours("gpt", clip_norm=0.0).batch, clip_norm=LORA_CLIP),
}


@dataclass(frozen=True, kw_only=True)
class ParityCell:
    """One parity cell: a family trained by the engine and, in lock-step, by plain PyTorch."""

    family: str
    """A key of FAMILIES."""
    stage: int
    """ZeRO stage 0-3."""
    world_size: int
    """N, a power of two dividing micro_batches (1/M and 1/N are then exact: A2 of anchors)."""
    mode: str = "deterministic"
    """'deterministic' (the reference's tree and op order) or 'fast' (the backend's)."""
    precision: str = "fp32"
    """'fp32' or 'bf16' (working copy and backward in bf16, fp32 master)."""
    steps: int = 4
    """Lock-steps S."""
    micro_batches: int = 4
    """M, the same at every N, so deterministic digests can be compared across N."""
    plant: str | None = None
    """None, or one of PLANTS in the plain side (non-vacuity tests only)."""
    clip_norm: float | None = None
    """None: the family's clip_norm."""
    perturb: float = 0.0
    """Non-vacuity: add perturb × bound to every compared engine value (at the element whose
    bound is largest; buffers: one ulp) before the checks; 10 must fail every check."""

    def __post_init__(self):
        def need(ok, name, allowed):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed are {allowed}")

        need(self.family in FAMILIES, "family", sorted(FAMILIES))
        need(self.stage in (0, 1, 2, 3), "stage", "0, 1, 2, 3")
        m = self.micro_batches
        need(m >= 1 and not m & (m - 1), "micro_batches", "a power of two")
        n = self.world_size
        need(
            n >= 1 and not n & (n - 1) and m % n == 0, "world_size", f"a power of two dividing {m}"
        )
        need(self.mode in ("deterministic", "fast"), "mode", "'deterministic', 'fast'")
        need(self.precision in ("fp32", "bf16"), "precision", "'fp32', 'bf16'")
        need(self.steps >= 1, "steps", "an integer >= 1")
        need(self.plant is None or self.plant in PLANTS, "plant", f"None or one of {PLANTS}")

    @property
    def clip(self) -> float:
        return FAMILIES[self.family].clip_norm if self.clip_norm is None else self.clip_norm

    def config(self, model) -> ZeroConfig:
        units = FAMILIES[self.family].units
        if units is None:
            units = tuple(model.unit_names()) if hasattr(model, "unit_names") else "auto"
        return ZeroConfig(
            stage=self.stage, precision=self.precision, deterministic=self.mode == "deterministic",
            optimizer="adamw", groups=GROUPS["adamw"], group_of=decay_matrices_only,
            micro_batches=self.micro_batches, clip_norm=self.clip, units=units, chunk=128,
        )  # fmt: skip


# -- running cells ------------------------------------------------------------------------------


def run_cell(rank: int, n: int, cell: ParityCell) -> dict:
    """One cell on this rank of an N-rank world; rank 0 also runs the plain side and checks.
    Returns {"ratios": [per step], "clipped": [per step], "digest"} (rank 0), or {"digest"}."""
    torch.manual_seed(0)
    family = FAMILIES[cell.family]
    model = family.build()
    eng = ZeroEngine(model, cell.config(model))
    plain = Plain(cell, family) if rank == 0 else None
    groups = "" if plain is None else group_mismatch(eng.group_index, plain.groups)
    per_rank, ratios, clipped, norms, res = cell.micro_batches // n, [], [], [], None
    for step in range(cell.steps):
        master, opt = eng.gather_state()
        t = eng.t
        buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
        for k in range(per_rank):
            batch = family.batch(step, k * n + rank)
            out = eng(**batch) if isinstance(batch, dict) else eng(*batch)
            eng.backward(family_loss(out))
        res = eng.step()
        after, after_opt = eng.gather_state()
        if plain is None:
            continue
        p = plain.step(master, opt, t, buffers, step)
        mine = {k: b.detach().float().numpy() for k, b in model.named_buffers()}
        bounds = step_bounds(cell, master, opt, t, p)
        ratios.append(check_step(bounds, p, res, after, after_opt, mine, cell.perturb))
        clipped.append(bool(cell.clip / (p.norm + 1e-6) < 1))
        norms.append(p.norm)
    digest = state_digest(eng, res)
    hf = hf_leg(rank, cell, family, eng, model)  # Hugging Face families: export, read back
    return {"ratios": ratios, "clipped": clipped, "norms": norms, "digest": digest,
            "groups": groups, "hf": hf}  # fmt: skip


def run_cells(rank: int, n: int, cells: list[ParityCell]) -> list[dict]:
    return each_cell(run_cell, rank, n, cells)


def row(cell: ParityCell, per_rank: list[dict]) -> dict:
    """The report row of one cell: its worst ratio per check, clipping per step, the digest."""
    config = {**asdict(cell), "clip_norm": cell.clip}
    errors = [r["error"] for r in per_rank if "error" in r]
    digests = {r.get("digest") for r in per_rank}
    lead = per_rank[0]
    out = {"config": config, "digest": lead.get("digest"), "ranks_agree": len(digests) == 1}
    if errors:
        return {**out, "passed": False, "first_failure": errors[0], "worst": {}, "clipped": []}
    worst = {k: max(r[k] for r in lead["ratios"]) for k in CHECKS}
    first = lead.get("groups") or lead.get("hf") or next(
        (f"step {i}: {k} ratio {r[k]:.3g}" for i, r in enumerate(lead["ratios"]) for k in CHECKS
         if not r[k] <= 1),
        "",
    )  # fmt: skip
    passed = not first and out["ranks_agree"]
    return {**out, "passed": passed, "first_failure": first or ("" if passed else "ranks differ"),
            "worst": worst, "clipped": lead["clipped"], "norms": lead["norms"],
            "steps": lead["ratios"]}  # fmt: skip


# -- presets, the section, its report -----------------------------------------------------------

WORLD_SIZES = (1, 2, 4)


def quick_cells() -> list[ParityCell]:
    """Three cells per family, N <= 2: fast bf16 at stage 3, deterministic fp32 at stage 1
    (N = 2) and stage 0 (N = 1), the last two giving the family's digest across N and stage."""
    plan = (
        (3, 2, "fast", "bf16"),
        (1, 2, "deterministic", "fp32"),
        (0, 1, "deterministic", "fp32"),
    )
    return [
        ParityCell(family=f, stage=s, world_size=n, mode=m, precision=p)
        for f in FAMILIES
        for s, n, m, p in plan
    ]


def complete_cells() -> list[ParityCell]:
    """Every family × stage 0-3 × N ∈ {1, 2, 4} × mode × precision."""
    return [
        ParityCell(family=f, stage=s, world_size=n, mode=m, precision=p)
        for f in FAMILIES
        for s in (0, 1, 2, 3)
        for n in WORLD_SIZES
        for m in ("deterministic", "fast")
        for p in ("fp32", "bf16")
    ]


def invariance(rows: list[dict]) -> list[dict]:
    """Deterministic cells of one family and precision (M is the same in all) must end in one
    digest at every N and stage (docs/design.md §2's world-size invariance, per family)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        c = r["config"]
        if c["mode"] == "deterministic" and not r.get("skipped") and c["plant"] is None:
            groups.setdefault((c["family"], c["precision"]), []).append(r)
    out = []
    for (family, precision), rs in groups.items():
        digests = {r["digest"] for r in rs}
        where = sorted({(r["config"]["world_size"], r["config"]["stage"]) for r in rs})
        passed = len(digests) == 1 and None not in digests and all(r["ranks_agree"] for r in rs)
        out.append({"family": family, "precision": precision, "cells": len(rs),
                    "world_sizes": sorted({n for n, _ in where}),
                    "stages": sorted({s for _, s in where}), "digests": sorted(map(str, digests)),
                    "passed": passed})  # fmt: skip
    return out


def console_row(r: dict) -> str:
    c = r["config"]
    head = f"  {c['family']:>6} stage {c['stage']} N={c['world_size']} {c['mode']:>13} "
    head += f"{c['precision']:>4}"
    if r.get("skipped"):
        return f"{head}  SKIPPED ({r['skipped']})"
    clip = "".join("c" if x else "." for x in r["clipped"])
    worst = max(r["worst"].items(), key=lambda kv: kv[1]) if r["worst"] else ("-", math.nan)
    verdict = "PASS" if r["passed"] else "FAIL " + r["first_failure"]
    return f"{head}  clip {clip:<5} worst {worst[0]} {worst[1]:.3g}  {verdict}"


def run_section(cells: list[ParityCell], *, timeout_s: float = 900, say=print, pool_run=None):
    """(rows, invariance rows) of the parity section; cells batched per world size. A family
    whose requirements are missing gives skipped rows naming the reason."""
    from ..cells.run import section_rows

    rows: dict[int, dict] = {}
    say("parity with plain PyTorch (lock-step; clip: c clipped, . not; worst diff/bound):")
    for i, c in enumerate(cells):
        why = FAMILIES[c.family].missing()
        if why:
            rows[i] = {"config": {**asdict(c), "clip_norm": c.clip}, "passed": True,
                       "skipped": why, "digest": None, "ranks_agree": True}  # fmt: skip
    rows |= section_rows(
        cells, run_cells, row, name="parity", timeout_s=timeout_s, say=say,
        show=lambda r: say(console_row(r)), skip=set(rows), pool=pool_run,
    )  # fmt: skip
    ordered = [rows[i] for i in sorted(rows)]
    for r in ordered:
        if r.get("skipped"):
            say(console_row(r))
    inv = invariance(ordered)
    for r in inv:
        mark = "PASS" if r["passed"] else f"FAIL {len(r['digests'])} digests"
        say(
            f"  {r['family']:>6} {r['precision']} deterministic: one digest over N "
            f"{r['world_sizes']} and stages {r['stages']} ({r['cells']} cells)  {mark}"
        )
    return ordered, inv


def markdown(rows: list[dict], inv: list[dict]) -> str:
    lines = ["", "## Parity with plain PyTorch", "",
             "| family | stage | N | mode | precision | clipped | worst check (diff/bound) | "
             "passed |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        c = r["config"]
        if r.get("skipped"):
            worst, clip = f"skipped: {r['skipped']}", ""
        else:
            clip = "".join("c" if x else "." for x in r["clipped"])
            k = max(r["worst"], key=r["worst"].get) if r["worst"] else "-"
            worst = f"{k} {r['worst'].get(k, math.nan):.3g}" if r["worst"] else r["first_failure"]
        lines.append(f"| {c['family']} | {c['stage']} | {c['world_size']} | {c['mode']} | "
                     f"{c['precision']} | {clip} | {worst} | {r['passed']} |")  # fmt: skip
    lines += [
        "",
        "| family | precision | N | stages | cells | one digest |",
        "|---|---|---|---|---|---|",
    ]
    for r in inv:
        lines.append(f"| {r['family']} | {r['precision']} | {r['world_sizes']} | {r['stages']} | "
                     f"{r['cells']} | {r['passed']} |")  # fmt: skip
    return "\n".join(lines) + "\n"
