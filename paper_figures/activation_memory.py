"""Residual memory: activations of the paper's GPT-2 1.5B example, and the formula's scaling,
measured on small GPTs with and without activation checkpointing.

The paper (§3.2, docs/paper.md §1.5): a 1.5B GPT-2 at sequence 1K and batch 32 needs "about 60 GB"
of activations, from the footnote ≈ 12 · hidden · batch · seq · layers elements; with activation
checkpointing "about 8 GB". One checkpoint per layer is batch · seq · hidden · layers elements,
5.0 GB in fp16. The difference to 8 GB is not stated in the paper; what a backward with
checkpoints also holds is the layer being recomputed: its own activations are live again while
its gradient is computed (12·b·s·h elements by the footnote, 1.3 GB here; more where attention
materialises its b·heads·s² scores, 1.1 GB per score tensor in fp16). 5.0 GB plus one such layer
brackets "about 8 GB"; the bracket is a reading, not a measurement of the paper's runs.

Measured here: the bytes autograd saves for backward (``measure.resident.saved_activations``: every
saved tensor, each storage once, parameters excluded), for a bf16 GPT with and without reentrant
``torch.utils.checkpoint`` around each block. The layers' part is isolated as saved(2l) - saved(l)
(embeddings, final norm and logits cancel) and divided by b·s·h·l·2 bytes: the constant of the
formula. The scaling holds if that constant stays the same while b, s, h and l vary.

Legend: b batch, s sequence length, h hidden size, l layers (transformer blocks), a heads.
"""

from __future__ import annotations

from pathlib import Path

from paper_figures.common import (
    Outputs,
    SummaryRow,
    compute_then_render,
    label_above,
    markdown_table,
    new_figure,
    save_figure,
)
from zero.common.results import make_record, provenance, write_atomic

NAME = "activation_memory"
GPT2_1_5B = {"hidden": 1600, "layers": 48, "heads": 16, "seq": 1024, "batch": 32}
"""The paper's example (§3.2): GPT-2 1.5B at sequence 1K, batch 32."""
PAPER_GB = {"no_checkpointing": 60.0, "checkpointing": 8.0}
"""The paper's "about 60 GB" and "about 8 GB" (docs/paper.md §1.5)."""
FOOTNOTE_ELEMENTS_PER_BSHL = 12
BYTES = 2  # fp16 / bf16


def footnote_bytes(*, hidden: int, batch: int, seq: int, layers: int, per: float = 12) -> float:
    """The paper's footnote: ≈ 12 · h · b · s · l elements, at 2 bytes each."""
    return per * hidden * batch * seq * layers * BYTES


def checkpoint_bytes(*, hidden: int, batch: int, seq: int, layers: int) -> float:
    """One checkpoint (the block's input) per layer: b · s · h · l elements, at 2 bytes each."""
    return hidden * batch * seq * layers * BYTES


def recompute_bracket(*, hidden: int, batch: int, seq: int, heads: int) -> tuple[float, float]:
    """Bytes live again while one layer is recomputed in backward: (the footnote's 12·b·s·h,
    that plus one b·a·s² attention-score tensor and its softmax), at 2 bytes per element."""
    layer = 12 * batch * seq * hidden * BYTES
    scores = batch * heads * seq * seq * BYTES
    return layer, layer + 2 * scores


def grid(profile: str) -> list[dict]:
    """Small GPT shapes (b, s, h, l): each dimension varied from a base alone."""
    base = {"batch": 2, "seq": 64, "hidden": 64, "layers": 2}
    out = [base]
    for key, values in {  # distinct factors, so that no two shapes share b·s·h·l
        "batch": (3, 8),
        "seq": (160, 512),
        "hidden": (192, 512),
        "layers": (8, 16),
    }.items():
        if profile == "smoke" and key != "layers":
            continue
        for v in values if profile == "full" else values[:1]:
            out.append({**base, key: v})
    return out


def saved_bytes(*, batch: int, seq: int, hidden: int, layers: int, checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one bf16 forward of a GPT (parameters excluded)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from measure.resident import saved_activations
    from zero.workloads.models import GPT, GPTConfig

    cfg = GPTConfig(
        vocab_size=64, block_size=seq, n_layer=layers, n_head=max(1, hidden // 32), n_embd=hidden
    )
    model = GPT(cfg, seed=0).to(torch.bfloat16)
    if checkpointing:
        for block in model.transformer.h:
            # reentrant: the block runs without grad and the checkpoint saves only its input,
            # so the hooks count exactly the checkpoints (measure.resident.saved_activations)
            block.forward = _checkpointed(block.forward, checkpoint)
    tokens = torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
    )
    with saved_activations(model.parameters()) as saved:
        _, loss = model(tokens, tokens)
    loss.backward()  # the saved tensors were real: backward must run through them
    return saved.nbytes


def _checkpointed(forward, checkpoint):
    return lambda x: checkpoint(forward, x, use_reentrant=True)


def compute(profile: str) -> dict:
    import torch

    torch.set_num_threads(1)
    prov = provenance()
    records = []
    for shape in grid(profile):
        for ckpt in (False, True):
            one = saved_bytes(**shape, checkpointing=ckpt)
            two = saved_bytes(**{**shape, "layers": 2 * shape["layers"]}, checkpointing=ckpt)
            config = {**shape, "checkpointing": ckpt, "dtype": "bf16", "model": "GPT"}
            result = {"saved_bytes": one, "saved_bytes_2l": two, "layers_bytes": two - one}
            records.append(
                make_record(
                    config=config, result=result, kind="activation.measured", provenance=prov
                )
            )
    paper_example = {
        "footnote_bytes": footnote_bytes(**_shape(GPT2_1_5B)),
        "checkpoint_bytes": checkpoint_bytes(**_shape(GPT2_1_5B)),
        "recompute_bracket": list(
            recompute_bracket(
                hidden=GPT2_1_5B["hidden"],
                batch=GPT2_1_5B["batch"],
                seq=GPT2_1_5B["seq"],
                heads=GPT2_1_5B["heads"],
            )
        ),
    }
    records.append(
        make_record(
            config=dict(GPT2_1_5B),
            result=paper_example,
            kind="activation.analytic",
            provenance=prov,
        )
    )
    return {"section": NAME, "records": records}


def _shape(d: dict) -> dict:
    return {k: d[k] for k in ("hidden", "batch", "seq", "layers")}


def constants(payload: dict) -> list[dict]:
    """Per measured shape: elements saved per layer per b·s·h (the formula's constant)."""
    out = []
    for r in payload["records"]:
        if r["kind"] != "activation.measured":
            continue
        c = r["config"]
        bshl = c["batch"] * c["seq"] * c["hidden"] * c["layers"]
        out.append({**c, "bshl": bshl, "constant": r["result"]["layers_bytes"] / (bshl * BYTES)})
    return out


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    consts = constants(payload)
    example = next(r for r in payload["records"] if r["kind"] == "activation.analytic")["result"]
    plain = [c for c in consts if not c["checkpointing"]]
    ckpt = [c for c in consts if c["checkpointing"]]
    spread = {
        name: (min(c["constant"] for c in cs), max(c["constant"] for c in cs))
        for name, cs in (("plain", plain), ("ckpt", ckpt))
    }
    e = _example_gb(example, plain)

    fig = new_figure((12, 5))
    left, right = fig.subplots(1, 2)
    _scaling_panel(left, consts, plain, ckpt, spread)
    _example_panel(right, e)
    fig.suptitle("Residual memory: activations, formula against measurement", fontsize=11)
    path = save_figure(fig, out.figure(NAME))
    write_atomic(out.table(NAME), _table(consts, spread, e))
    return path, (
        f"footnote {e['footnote']:.1f} GB vs paper 60; checkpoints {e['ckpts']:.2f} GB "
        f"(+recompute {e['ckpts'] + e['lo']:.1f}-{e['ckpts'] + e['hi']:.1f}) vs paper 8"
    )


def _example_gb(example: dict, plain: list[dict]) -> dict[str, float]:
    """The paper's example in GB: the footnote's bytes, ours at the measured constant (mean
    over the shapes without checkpointing), the checkpoints, and the recompute bracket (lo, hi)."""
    gb = 1e9
    lo, hi = example["recompute_bracket"]
    footnote = example["footnote_bytes"] / gb
    measured_c = sum(c["constant"] for c in plain) / len(plain)
    return {
        "footnote": footnote,
        "measured_c": measured_c,
        "ours_plain": footnote / 12 * measured_c,
        "ckpts": example["checkpoint_bytes"] / gb,
        "lo": lo / gb,
        "hi": hi / gb,
    }


def _scaling_panel(ax, consts: list[dict], plain: list[dict], ckpt: list[dict], spread: dict):
    """The small GPTs: bytes the layers save against b·s·h·l, beside the two formulas."""
    for cs, label, marker in (
        (plain, "no checkpointing", "o"),
        (ckpt, "one checkpoint per layer", "s"),
    ):
        ax.scatter(
            [c["bshl"] for c in cs],
            [c["constant"] * c["bshl"] * BYTES for c in cs],
            marker=marker,
            label=f"measured, {label}",
            zorder=3,
        )
    xs = sorted({c["bshl"] for c in consts})
    span = [xs[0] / 1.5, xs[-1] * 1.5]
    ax.plot(span, [12 * x * BYTES for x in span], "k--", label="footnote: 12·b·s·h·l elements")
    ax.plot(span, [x * BYTES for x in span], "k:", label="checkpoints: b·s·h·l elements")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("b·s·h·l (batch · sequence · hidden · layers)")
    ax.set_ylabel("bytes saved for backward by the layers (bf16)")
    ax.set_title(
        f"small GPTs: {spread['plain'][0]:.2f}-{spread['plain'][1]:.2f} elements per b·s·h·l "
        f"without, {spread['ckpt'][0]:.2f}-{spread['ckpt'][1]:.2f} with checkpointing",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _example_panel(ax, e: dict[str, float]) -> None:
    """GPT-2 1.5B (paper §3.2): the formulas and ours beside the paper's 60 GB and 8 GB."""
    ckpts = e["ckpts"]
    ax.bar([-0.3], [e["footnote"]], 0.2, color="#4878a8", label="footnote formula (12·bshl)")
    measured = f"measured constant ({e['measured_c']:.1f}·bshl)"
    ax.bar([-0.1], [e["ours_plain"]], 0.2, color="#8c6bb1", label=measured)
    ax.bar([0.1], [PAPER_GB["no_checkpointing"]], 0.2, color="#d9d9d9", hatch="..", label="paper")
    ax.bar([0.7], [ckpts], 0.2, color="#5a9e5a", label="checkpoints (bshl)")
    ax.bar([0.9], [ckpts + e["lo"]], 0.2, color="#9fd39f", label="+ one layer recomputed (12·bsh)")
    ax.bar([1.1], [ckpts + e["hi"]], 0.2, color="#c7e9c0", label="+ its attention scores")
    ax.bar([1.3], [PAPER_GB["checkpointing"]], 0.2, color="#d9d9d9", hatch="..")
    for patch in ax.patches:
        label_above(
            ax,
            f"{patch.get_height():.1f}",
            (patch.get_x() + patch.get_width() / 2, patch.get_height()),
            points=2,
            fontsize=7,
        )
    ax.set_xticks([0, 1])
    ax.set_xticklabels(["no checkpointing", "activation checkpointing"])
    ax.set_ylabel("activation memory (GB, fp16)")
    ax.set_title("GPT-2 1.5B, seq 1K, batch 32 (paper §3.2)", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


def _table(consts: list[dict], spread: dict, e: dict[str, float]) -> str:
    """tables/activation_memory.md: every measured shape, and the paper's example."""
    rows = [
        [
            str(c["batch"]),
            str(c["seq"]),
            str(c["hidden"]),
            str(c["layers"]),
            "yes" if c["checkpointing"] else "no",
            f"{c['constant'] * c['bshl'] * BYTES:,.0f}",
            f"{c['constant']:.4f}",
        ]
        for c in consts
    ]
    ckpts = e["ckpts"]
    lines = [
        "# Activation memory: the footnote's formula against measurement",
        "",
        "Measured: bytes that autograd saves for backward in the layers of a bf16 GPT",
        "(saved(2l) - saved(l), each storage once, parameters excluded), with and without",
        "reentrant activation checkpointing around each block.",
        "",
        *markdown_table(
            ["b", "s", "h", "l", "checkpointing", "layer bytes", "elements per b·s·h·l"], rows
        ),
        "",
        f"Without checkpointing the constant is {spread['plain'][0]:.3f}-{spread['plain'][1]:.3f}",
        "across the grid, above the footnote's 12 because this GPT saves more per layer (the",
        "MLP's 4h-wide input and output of GELU alone are 8, q, k, v and attention's output 4,",
        "the norms' inputs and outputs the rest; LayerNorm's per-row statistics and attention's",
        "log-sum-exp add the fraction that does not scale with h). With one checkpoint per",
        f"layer it is {spread['ckpt'][0]:.3f}-{spread['ckpt'][1]:.3f}: the checkpoint's b·s·h.",
        "Either way the bytes scale as b·s·h·l, which is the formula's claim.",
        "",
        "GPT-2 1.5B, seq 1K, batch 32 (fp16): footnote "
        f"{e['footnote']:.1f} GB (paper: about {PAPER_GB['no_checkpointing']:g} GB); our measured "
        f"constant would give {e['ours_plain']:.1f} GB. With checkpointing: checkpoints "
        f"{ckpts:.2f} GB;",
        "plus the one layer recomputed during backward "
        f"{ckpts + e['lo']:.2f} GB, plus its attention scores {ckpts + e['hi']:.2f} GB",
        f"(paper: about {PAPER_GB['checkpointing']:g} GB; the paper does not say what its 8 GB",
        "holds beyond the checkpoints).",
        "",
    ]
    return "\n".join(lines)


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)
