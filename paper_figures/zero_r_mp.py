"""C1-C5 with model parallelism (the paper's Figures 6 and 7 at MP = 16), on simulated ranks.

One process plays rank (0, 0) of an N_d × N_m mesh on the fake process group ([Note: simulated
MP rank] in measure/fake_rank.py): it builds its TPGPT slice, runs ZeRO in its DP group and two
real steps, and is measured from outside (RSS). measure.budget.compare finds each
configuration's largest GPT within a per-rank budget (Figure 6) and the peaks of two fixed
models (Figure 7: A = C1's largest; B = half-way between C3's and C4's largest, like the paper's
100B, which had no C1-C3 bars). With N_m > 1 all five configurations differ: P_a keeps 1/N_m of
each checkpoint (C2, C4), P_a+cpu keeps that part in host memory (C5).

Beside the measurement, ``estimate`` gives the same rank by category from zero.common.memory (model
states of the slice at N = N_d; checkpoints by ``checkpoint_bytes``), and the counted MP traffic
gives P_a's share of it (the paper's "< 10%", §7). Profiles: ``full`` measures (FULL, below)
and rewrites ``measured/zero_r_mp.json``; ``quick`` and ``smoke`` render that record.

Legend: N_d DP degree, N_m MP degree, L blocks, h hidden, b batch per rank, s sequence, X = b·s·h.
"""

from __future__ import annotations

from pathlib import Path

from measure.budget import Setup
from measure.mp_rank import estimate
from paper_figures import paper
from paper_figures.common import (
    Outputs,
    SummaryRow,
    compute_then_render,
    label_above,
    markdown_table,
    new_figure,
    save_figure,
)
from zero.common.results import provenance, read_json, write_atomic, write_json

NAME = "zero_r_mp"
MEASURED = Path(__file__).resolve().parent / "measured" / f"{NAME}.json"
NAMES = ("C1", "C2", "C3", "C4", "C5")
MIB = 2**20

FULL = Setup(
    world_size=16,
    mp=16,
    hidden=128,
    heads=16,
    seq=16,
    batch=16,
    vocab_size=256,
    contiguous_memory=False,
    deterministic=False,
    budget_bytes=32 * MIB,
)
"""[Note: the MP scale] N_m = 16, the paper's MP: every rank fits (a slice of 13K parameters per
block), so the largest N_m is the paper's. h = 128 with 16 heads (8 per head) keeps a block's
checkpoint (X = b·s·h, b = 16 as in Figure 6) 1.3× its P_os slice states (the paper's 40B at MP
16: 1.2×, measure/budget.Setup's proportion); s = 16 keeps one probe within seconds of compute
on a loaded 2-core machine. N_d = 16: shards are padded to N_d·128 elements per unit, 9% of a
slice block here (25, the paper's N_d, would pad 22%). M_D is off for all five alike (with it, P_a's
parts would sit in its checkpoint arena: where the bytes live, not how many); MP sums in fast
mode (all-reduce, as Megatron's)."""

COMMAND = "python -m paper_figures --only zero_r_mp --profile full"
RESOLUTION = 0.05
"""The largest model is searched to within 5% (bisection stops there): each probe is a fresh
process, tens of seconds on the loaded machine."""


def per_block(payload: dict, small: int = 8, large: int = 32) -> dict[str, dict]:
    """Per configuration, what one more block costs at the peak: the slope of the measured
    device peak between the search's two guide probes (L = 8 and 32), beside the estimate's
    resident bytes per block, and the difference per padded slice parameter."""
    setup = Setup(**payload["setup"])
    probes = {(p["name"], p["layers"]): p for p in payload.get("probes", [])}
    out = {}
    for name in NAMES:
        if (name, small) not in probes or (name, large) not in probes:
            continue
        e = [estimate(setup, name, n) for n in (small, large)]
        held = [x["model_states"] + x["checkpoints_device"] for x in e]
        span = large - small
        measured = (
            probes[(name, large)]["device_peak"] - probes[(name, small)]["device_peak"]
        ) / span
        est = (held[1] - held[0]) / span
        params = (e[1]["padded_params"] - e[0]["padded_params"]) / span
        out[name] = {
            "measured": measured,
            "estimated": est,
            "extra_per_param": (measured - est) / params,
        }
    return out


def p_a_share(payload: dict) -> dict | None:
    """P_a's all-gathers as a fraction of the other MP traffic, from two probes of one model
    that differ only by P_a (C3 and C4 on model A): the counted elements per rank (§7)."""
    probes = {(p["name"], p["layers"], p["batch"]): p for p in payload.get("probes", [])}
    layers, batch = payload["models"]["A"], payload["setup"]["batch"]
    c3, c4 = probes.get(("C3", layers, batch)), probes.get(("C4", layers, batch))
    if not c3 or not c4 or "mp_traffic" not in c4:
        return None
    base = sum(c3["mp_traffic"].values())
    extra = c4["mp_traffic"].get("p_a", 0)
    assert sum(v for k, v in c4["mp_traffic"].items() if k != "p_a") == base  # P_a adds only this
    return {"layers": layers, "p_a": extra, "mp": base, "share": extra / base}


def compute(profile: str) -> dict:
    if profile != "full":
        if not MEASURED.exists():
            return {"section": NAME, "source": f"no {MEASURED.name}: run {COMMAND}"}
        return {**read_json(MEASURED), "section": NAME}
    from measure.budget import compare

    def say(msg: str) -> None:
        print(f"  [{NAME}] {msg}", flush=True)

    got = compare(
        FULL, throughput=False, fragmentation_probes=False, resolution=RESOLUTION, log=say
    )
    payload = {"section": NAME, "source": "measured by this run", "provenance": provenance()}
    payload.update(got)
    payload["estimates"] = {
        label: {n: estimate(FULL, n, layers) for n in NAMES}
        for label, layers in got["models"].items()
    }
    write_json(MEASURED, {**payload, "source": f"carried from {MEASURED.name} ({COMMAND})"})
    return payload


def fig6(payload: dict) -> list[dict]:
    """Per configuration: the largest model (blocks, parameters of the whole model and of the
    rank's slice), ours and the paper's, both ÷ C1's."""
    c1 = payload["largest"]["C1"]["num_params"]
    rows = []
    for name in NAMES:
        got = payload["largest"][name]
        theirs = paper.FIG6_MAX_BILLIONS[name]
        rows.append(
            {
                "name": name,
                "layers": got["layers"],
                "num_params": got["num_params"],
                "ours_vs_c1": got["num_params"] / c1,
                "paper_billions": theirs,
                "paper_vs_c1": theirs / paper.FIG6_MAX_BILLIONS["C1"],
            }
        )
    return rows


def fig7(payload: dict) -> list[dict]:
    """Per model (A, B) and configuration: measured device peak, the estimate's resident bytes
    (model states + device checkpoints), host checkpoints, the paper's GB."""
    rows = []
    for i, (label, layers) in enumerate(payload["models"].items()):
        for name in NAMES:
            got = payload["memory"][label][name]
            est = payload["estimates"][label][name]
            rows.append(
                {
                    "model": label,
                    "layers": layers,
                    "name": name,
                    "device_peak": got["device_peak"],
                    "model_states": got["model_states"],
                    "estimated_states": est["model_states"],
                    "estimated_device": est["model_states"] + est["checkpoints_device"],
                    "checkpoints_device": est["checkpoints_device"],
                    "host": got["activation_host_bytes"],
                    "estimated_host": est["checkpoints_host"],
                    "paper_gb": paper.FIG7_GB[paper.FIG7_MODELS[i]].get(name),
                }
            )
    return rows


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: Figure 6 at MP ÷ C1, Figure 7's peaks ÷ C1, P_a's traffic share."""
    if "setup" not in payload:
        return []
    prov, setup = payload.get("provenance", {}), payload["setup"]
    where = (
        f"measured ({prov.get('date_utc', '?')[:10]}), rank (0, 0) of "
        f"{setup['world_size']} × {setup['mp']} simulated"
    )
    machine = f"CPU, {prov.get('cpu_count', '?')} cores"
    rows = []
    for r in fig6(payload)[1:]:
        rows.append(
            [
                f"Figure 6 at MP {setup['mp']}, largest model {r['name']} ÷ C1's",
                f"{r['paper_vs_c1']:.2f} ({r['paper_billions']}B ÷ 40B)",
                f"{r['ours_vs_c1']:.2f} ({r['layers']} blocks)",
                f"{r['ours_vs_c1'] / r['paper_vs_c1']:.2f}",
                where,
                machine,
            ]  # fmt: skip
        )
    a = {r["name"]: r for r in fig7(payload) if r["model"] == "A"}
    c1 = a["C1"]["device_peak"]
    for name in NAMES[1:]:
        theirs = paper.FIG7_GB["40B"][name] / paper.FIG7_GB["40B"]["C1"]
        ours = a[name]["device_peak"] / c1
        rows.append(
            [
                f"Figure 7 at MP {setup['mp']}, peak {name} ÷ C1's (C1's largest model)",
                f"{theirs:.2f} (40B)",
                f"{ours:.2f}",
                f"{ours / theirs:.2f}",
                where,
                machine,
            ]  # fmt: skip
        )
    share = p_a_share(payload)
    if share:
        rows.append(
            [
                "§7, P_a's extra traffic ÷ MP's (counted elements per rank)",
                "< 10% (1/12)",
                f"{share['share']:.1%}",
                f"{share['share'] * 12:.2f} (÷ 1/12)",
                where,
                machine,
            ]  # fmt: skip
        )
    return rows


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


# -- the figure and the table: Figures 6 and 7 at MP 16, the estimate beside each peak --------


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    if "setup" not in payload:  # nothing measured yet: say so rather than draw nothing
        path = write_atomic(out.table(NAME), f"# C1-C5 with MP\n\n{payload['source']}\n")
        return path, payload["source"]
    setup, budget = payload["setup"], payload["setup"]["budget_bytes"]
    six, seven = fig6(payload), fig7(payload)
    fig = new_figure((16, 5))
    ax6, ax7, axe = fig.subplots(1, 3)
    xs = range(len(NAMES))
    ax6.bar([x - 0.2 for x in xs], [r["ours_vs_c1"] for r in six], 0.4, label="ours (measured)")
    ax6.bar([x + 0.2 for x in xs], [r["paper_vs_c1"] for r in six], 0.4, label="paper", color="C7")
    for x, r in zip(xs, six, strict=True):
        label_above(ax6, f"{r['layers']} bl.", (x - 0.2, r["ours_vs_c1"]), fontsize=6)
        label_above(ax6, f"{r['paper_billions']}B", (x + 0.2, r["paper_vs_c1"]), fontsize=7)
    ax6.set_xticks(list(xs), NAMES)
    ax6.set_xlabel("configuration (paper's Table 3)")
    ax6.set_ylabel("largest model ÷ C1's")
    ax6.set_title(f"Fig. 6 at MP {setup['mp']}: largest model, batch {setup['batch']}/rank")
    ax6.legend(loc="upper left", fontsize=8)
    for i, label in enumerate(payload["models"]):
        here = [r for r in seven if r["model"] == label]
        pos = [x + (i - 0.5) * 0.4 for x in xs]
        ax7.bar(pos, [r["device_peak"] / MIB for r in here], 0.4, label=f"model {label} "
                f"({here[0]['layers']} blocks), measured")  # fmt: skip
        ax7.scatter(pos, [r["estimated_device"] / MIB for r in here], color="k", marker="_",
                    s=120, zorder=3, label="estimated resident" if i == 0 else None)  # fmt: skip
    ax7.axhline(budget / MIB, color="k", ls="--", lw=1, label="budget")
    ax7.set_xticks(list(xs), NAMES)
    ax7.set_xlabel("configuration")
    ax7.set_ylabel("device peak above baseline (MiB)")
    ax7.set_title("Fig. 7: peak of two fixed models")
    ax7.legend(fontsize=7)
    a = [r for r in seven if r["model"] == "A"]
    bottom = [0.0] * len(a)
    for key, what in (("estimated_states", "model states (estimated)"),
                      ("checkpoints_device", "checkpoints on device (estimated)")):  # fmt: skip
        vals = [r[key] / MIB for r in a]
        axe.bar(list(xs), vals, 0.6, bottom=bottom, label=what)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axe.scatter(list(xs), [r["model_states"] / MIB for r in a], color="k", marker="x",
                zorder=3, label="model states (engine, measured)")  # fmt: skip
    axe.set_xticks(list(xs), NAMES)
    axe.set_xlabel("configuration")
    axe.set_ylabel("MiB on rank (0, 0)")
    axe.set_title("Model A: what the rank keeps, by category")
    axe.legend(fontsize=7)
    fig.suptitle(
        f"C1-C5 on rank (0, 0) of N_d × N_m = {setup['world_size']} × {setup['mp']} (simulated): "
        f"GPT h = {setup['hidden']}, {setup['heads']} heads, seq {setup['seq']}, budget "
        f"{budget / MIB:.0f} MiB",
        fontsize=9,
    )
    path = save_figure(fig, out.figure(NAME))
    write_atomic(out.table(NAME), table(payload))
    return path, f"C1-C5 at MP {setup['mp']} ({payload['source']})"


def table(payload: dict) -> str:
    setup, prov = payload["setup"], payload.get("provenance", {})
    lines = [
        f"# C1-C5 with model parallelism (MP = {setup['mp']}): the paper's Figures 6 and 7",
        "",
        f"Rank (0, 0) of an N_d × N_m = {setup['world_size']} × {setup['mp']} mesh, simulated on "
        f"the fake process group; GPT h = {setup['hidden']}, {setup['heads']} heads, vocabulary "
        f"{setup['vocab_size']}, seq {setup['seq']}, batch {setup['batch']}/rank, bf16, Adam, "
        f"one checkpoint per block, C_B = {setup['bucket_elements']} elements, M_D off, MP sums "
        f"in {'deterministic' if setup['deterministic'] else 'fast'} mode. Budget "
        f"{setup['budget_bytes'] / MIB:.0f} MiB above the baseline (two steps; the peak "
        f"includes the ~20 MB a first step costs whatever the model). Measured "
        f"{prov.get('date_utc', '?')[:10]} on {prov.get('cpu_count', '?')} CPU cores "
        f"({payload['source']}). Search resolution {RESOLUTION:.0%}.",
        "",
        "## Figure 6: largest model (paper: MP 16, batch 16, 400 V100 32 GB)",
        "",
    ]
    rows = [
        [
            r["name"],
            str(r["layers"]),
            f"{r['num_params'] / 1e6:.2f}M",
            f"{r['ours_vs_c1']:.2f}",
            f"{r['paper_billions']}B",
            f"{r['paper_vs_c1']:.2f}",
        ]  # fmt: skip
        for r in fig6(payload)
    ]
    lines += markdown_table(["C", "blocks", "parameters", "÷ C1", "paper", "paper ÷ C1"], rows)
    lines += ["", "## Figure 7: device peak (MiB) on two fixed models, beside the estimate", ""]
    rows = [
        [
            f"{r['model']} ({r['layers']} blocks)",
            r["name"],
            f"{r['device_peak'] / MIB:.1f}",
            f"{r['model_states'] / MIB:.2f} = {r['estimated_states'] / MIB:.2f}",
            f"{r['checkpoints_device'] / MIB:.2f}",
            f"{r['host'] / MIB:.2f} = {r['estimated_host'] / MIB:.2f}",
            "–" if r["paper_gb"] is None else f"{r['paper_gb']:g} GB",
        ]  # fmt: skip
        for r in fig7(payload)
    ]
    head = ["model", "C", "device peak", "model states: engine = estimate",
            "checkpoints on device (est.)", "host checkpoints: counted = estimate",
            "paper (40B / 100B)"]  # fmt: skip
    lines += markdown_table(head, rows)
    lines += _slope_and_share_lines(payload)
    lines += ["", *NOTES, ""]
    return "\n".join(lines)


def _slope_and_share_lines(payload: dict) -> list[str]:
    """One more block's peak slope against the estimate, and P_a's share of the MP traffic,
    where the records have them."""
    lines: list[str] = []
    slopes = per_block(payload)
    if slopes:
        lines += ["", "## One more block: peak slope (L = 8 → 32) against the estimate", ""]
        rows = [
            [
                n,
                f"{v['measured'] / 1024:.1f}",
                f"{v['estimated'] / 1024:.1f}",
                f"{v['extra_per_param']:.1f}",
            ]  # fmt: skip
            for n, v in slopes.items()
        ]
        head = ["C", "measured KiB/block", "estimated resident KiB/block", "extra B per parameter"]
        lines += markdown_table(head, rows)
        lines += [
            "",
            "The estimate's differences between configurations show in the measured slopes; on top",
            "of them every configuration's peak grows by about 8 B per slice parameter that the",
            "estimate does not hold (a transient of the step proportional to the model; not",
            "attributed here).",
        ]
    share = p_a_share(payload)
    if share:
        lines += [
            "",
            f"P_a's traffic (model A, {share['layers']} blocks, two steps): {share['p_a']:,} "
            f"elements sent per rank against {share['mp']:,} for the rest of MP: "
            f"{share['share']:.1%} (paper §7: < 10%).",
        ]
    return lines


NOTES = (
    "What differs from the paper:",
    "",
    "- The peak includes what any first step leaves (kernel workspaces, autograd's thread),",
    "  a constant that is a larger part of a 32 MiB budget than of 32 GB: ratios to C1 shrink.",
    "- C5's P_a+cpu parts stay in the process on a CPU-only machine; their bytes, counted",
    "  exactly by the engine, are subtracted from the peak ([Note: measured, not modelled]).",
    "- Figure 8 (throughput) is not measured here: collectives on the fake group cost nothing,",
    "  and the paper's MP-bound small batches cannot show on one simulated rank.",
)
