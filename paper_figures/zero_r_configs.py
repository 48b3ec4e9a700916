"""The paper's C1-C5 comparison (Table 3; Figures 6, 7 and 8) at our scale, measured.

Each configuration (measure.budget.CONFIGURATIONS) runs on one simulated rank of N_d = 64 with a
per-rank memory budget; measure.budget.compare finds, by measured probes:

- Figure 6: the largest GPT (blocks of width 64, batch 16 per rank) within the budget;
- Figure 7: the device peak of every configuration on two fixed models (A: C1's largest; B:
  beyond C3's largest, where the paper's 100B model had no C1-C3 bars);
- Figure 8: on the same two models, the largest batch each configuration fits and its step time.

Without model parallelism C2 ≡ C1 and C4 ≡ C3 (P_a partitions checkpoints over the MP group), and
C5's P_a+cpu is "checkpoints in host memory"; the figure says so. The paper's values (MP = 16, 400
V100s, docs/paper.md §1.6-§1.8) are set beside ours as ratios to C1, since the scales differ by
10^4.

The probes run with glibc's mmap threshold fixed, so that the RSS peak measures what the
configuration needs rather than the heap's fragmentation; the table also gives C3's peak with
and without M_D under the default allocator ([Note: the CPU allocator] in measure/budget.py).

The quick and smoke profiles render the committed measurement (``measured/zero_r_configs.json``,
tens of minutes on 2 cores); ``--profile full`` measures again and rewrites it. Writes
results/zero_r_configs.json, figures/zero_r_configs.png and tables/zero_r_configs.md."""

from __future__ import annotations

from pathlib import Path

from measure.budget import step_time
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

NAME = "zero_r_configs"
MEASURED = Path(__file__).resolve().parent / "measured" / f"{NAME}.json"
NAMES = ("C1", "C2", "C3", "C4", "C5")
MIB = 2**20


def compute(profile: str) -> dict:
    if profile == "full":
        from measure.budget import Setup, compare

        def say(msg: str) -> None:
            print(f"  [{NAME}] {msg}", flush=True)

        payload = {
            "section": NAME,
            "source": "measured by this run",
            "provenance": provenance(),
            **compare(Setup(), log=say),
        }
        write_json(MEASURED, {**payload, "source": f"carried from {MEASURED.name}"})
        return payload
    if not MEASURED.exists():
        return {"section": NAME, "source": f"no {MEASURED.name}: run --profile full"}
    return {**read_json(MEASURED), "section": NAME}


def _own(payload: dict, name: str) -> str:
    """The configuration whose measurement stands for `name` (C2 -> C1, C4 -> C3)."""
    conf = next(c for c in payload["configurations"] if c["name"] == name)
    return conf["same_as"] or name


def fig6(payload: dict) -> list[dict]:
    """Per configuration: our largest model (parameters, blocks), the paper's, both ÷ C1's."""
    ours_c1 = payload["largest"]["C1"]["num_params"]
    rows = []
    for name in NAMES:
        got = payload["largest"][_own(payload, name)]
        rows.append(
            {
                "name": name,
                "same_as": None if _own(payload, name) == name else _own(payload, name),
                "layers": got["layers"],
                "num_params": got["num_params"],
                "ours_vs_c1": got["num_params"] / ours_c1,
                "paper_billions": paper.FIG6_MAX_BILLIONS[name],
                "paper_vs_c1": paper.FIG6_MAX_BILLIONS[name] / paper.FIG6_MAX_BILLIONS["C1"],
            }
        )
    return rows


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    if "setup" not in payload:  # nothing measured yet: say so rather than draw nothing
        path = write_atomic(out.table(NAME), f"# C1-C5 at our scale\n\n{payload['source']}\n")
        return path, payload["source"]
    setup = payload["setup"]
    budget = setup["budget_bytes"]
    six = fig6(payload)
    models = payload["models"]
    fig = new_figure((17, 5))
    ax6, ax7, ax8 = fig.subplots(1, 3)

    # Figure 6: largest model, ÷ C1's, ours beside the paper's.
    xs = range(len(six))
    ax6.bar([x - 0.2 for x in xs], [r["ours_vs_c1"] for r in six], 0.4, label="ours (measured)")
    ax6.bar([x + 0.2 for x in xs], [r["paper_vs_c1"] for r in six], 0.4, label="paper", color="C7")
    for x, r in zip(xs, six, strict=True):
        tag = f"{r['num_params'] / 1e6:.1f}M" + (f"\n(= {r['same_as']})" if r["same_as"] else "")
        label_above(ax6, tag, (x - 0.2, r["ours_vs_c1"]), fontsize=7)
        label_above(ax6, f"{r['paper_billions']}B", (x + 0.2, r["paper_vs_c1"]), fontsize=7)
    ax6.set_xticks(list(xs), NAMES)
    ax6.set_ylabel("largest model ÷ C1's")
    ax6.set_xlabel("configuration (paper's Table 3)")
    ax6.set_title(f"Fig. 6: largest model, batch {setup['batch']}/rank")
    ax6.legend(loc="upper left", fontsize=8)

    # Figure 7: device peak on models A and B, against the budget.
    distinct = [n for n in NAMES if _own(payload, n) == n]
    width = 0.8 / len(models)
    for i, (label, layers) in enumerate(models.items()):
        got = payload["memory"][label]
        peaks = [got[n]["device_peak"] / MIB for n in distinct]
        pos = [x + (i - 0.5) * width for x in range(len(distinct))]
        bars = ax7.bar(pos, peaks, width, label=f"model {label}: {layers} blocks")
        for bar, n in zip(bars, distinct, strict=True):
            if got[n]["device_peak"] > budget:
                bar.set_hatch("//")
                label_above(ax7, "over", (bar.get_x() + width / 2, bar.get_height()), fontsize=7)
    ax7.axhline(budget / MIB, color="k", ls="--", lw=1, label="budget")
    ax7.set_xticks(range(len(distinct)), [_with_same(payload, n) for n in distinct])
    ax7.set_ylabel("device peak above baseline (MiB)")
    ax7.set_xlabel("configuration")
    ax7.set_title("Fig. 7: memory of two fixed models")
    ax7.legend(fontsize=8)

    # Figure 8: tokens/s at the largest batch that fits.
    for i, label in enumerate(models):
        got = payload["throughput"][label]
        pos = [x + (i - 0.5) * width for x in range(len(distinct))]
        for x, n in zip(pos, distinct, strict=True):
            p = got[n]
            if p is None:
                label_above(ax8, "✗", (x, 0), fontsize=9)
                continue
            rate = p["batch"] * setup["seq"] / step_time(p)
            ax8.bar(x, rate, width, color=f"C{i}", label=f"model {label}" if x == pos[0] else None)
            label_above(ax8, f"b={p['batch']}", (x, rate), fontsize=7)
    ax8.set_xticks(range(len(distinct)), [_with_same(payload, n) for n in distinct])
    ax8.set_ylabel("tokens/s, one rank (collectives not timed)")
    ax8.set_xlabel("configuration")
    ax8.set_title("Fig. 8: throughput at the largest batch that fits")
    ax8.legend(fontsize=8)
    fig.suptitle(
        f"C1-C5 at our scale: GPT h = {setup['hidden']}, seq {setup['seq']}, rank 0 of "
        f"N_d = {setup['world_size']}, budget {budget / MIB:.0f} MiB. No model parallelism: "
        "C2 = C1, C4 = C3 (P_a has nothing to partition); C5 = C3 + checkpoints in host memory",
        fontsize=9,
    )
    path = save_figure(fig, out.figure(NAME))
    write_atomic(out.table(NAME), table(payload))
    return path, f"C1/C3/C5 measured ({payload['source']})"


def _with_same(payload: dict, name: str) -> str:
    twins = [n for n in NAMES if _own(payload, n) == name and n != name]
    return "=".join([name, *twins])


def table(payload: dict) -> str:
    lines = _heading(payload)
    lines += _fig6_lines(payload)
    lines += _fragmentation_lines(payload)
    lines += _fig7_lines(payload)
    lines += _fig8_lines(payload)
    lines += ["", *NOTES, ""]
    return "\n".join(lines)


def _heading(payload: dict) -> list[str]:
    """The title, the setup and the provenance, and Figure 6's heading."""
    setup = payload["setup"]
    prov = payload.get("provenance", {})
    return [
        "# C1-C5 at our scale (the paper's Figures 6-8)",
        "",
        f"One simulated rank (rank 0 of N_d = {setup['world_size']}, fake process group), GPT "
        f"of L blocks, hidden {setup['hidden']}, {setup['heads']} head(s), vocabulary "
        f"{setup['vocab_size']}, seq {setup['seq']}, bf16 working copy and reduction, Adam, "
        f"one checkpoint per block, C_B = {setup['bucket_elements']} elements, M_D "
        f"{'on' if setup['contiguous_memory'] else 'off'}. Budget "
        f"{setup['budget_bytes'] / MIB:.0f} MiB above the baseline; glibc's mmap threshold "
        f"{setup['malloc_mmap_threshold']} B. Measured "
        f"{prov.get('date_utc', '?')[:10]} on {prov.get('cpu_count', '?')} CPU cores "
        f"({payload['source']}).",
        "",
        "## Figure 6: largest model at batch "
        f"{setup['batch']} per rank (paper: MP 16, batch 16, 400 V100 32 GB)",
        "",
    ]


def _fig6_lines(payload: dict) -> list[str]:
    """Figure 6: each configuration's largest model, ours and the paper's, both ÷ C1's."""
    rows = [
        [
            r["name"] + (f" (= {r['same_as']})" if r["same_as"] else ""),
            f"{r['layers']}",
            f"{r['num_params'] / 1e6:.2f}M",
            f"{r['ours_vs_c1']:.2f}",
            f"{r['paper_billions']}B",
            f"{r['paper_vs_c1']:.2f}",
        ]
        for r in fig6(payload)
    ]
    return markdown_table(["C", "blocks", "parameters", "÷ C1", "paper", "paper ÷ C1"], rows)


def _fragmentation_lines(payload: dict) -> list[str]:
    """C3's device peak with M_D on and off, under both allocators."""
    layers = payload["largest"]["C3"]["layers"]
    lines = ["", f"## Fragmentation: C3 at {layers} blocks, device peak (MiB)", ""]
    rows = [
        [
            "glibc default"
            if f["malloc_mmap_threshold"] is None
            else f"mmap threshold {f['malloc_mmap_threshold']} B",
            "on" if f["contiguous_memory"] else "off",
            f"{f['device_peak'] / MIB:.1f}",
            f"{f['model_states'] / MIB:.1f}",
        ]
        for f in payload.get("fragmentation", [])
    ]
    lines += markdown_table(["allocator", "M_D", "device peak", "model states"], rows)
    return lines


def _fig7_lines(payload: dict) -> list[str]:
    """Figure 7: each configuration's device peak on the two fixed models."""
    setup = payload["setup"]
    lines = ["", "## Figure 7: device peak (MiB) on two fixed models", ""]
    rows = []
    for label, layers in payload["models"].items():
        for n in NAMES:
            p = payload["memory"][label][_own(payload, n)]
            theirs = paper.FIG7_GB[paper.FIG7_MODELS[0 if label == "A" else 1]].get(n)
            rows.append(
                [
                    f"{label} ({layers} blocks)",
                    n,
                    f"{p['device_peak'] / MIB:.1f}"
                    + (" (over)" if p["device_peak"] > setup["budget_bytes"] else ""),
                    f"{p['model_states'] / MIB:.1f}",
                    f"{p['activation_host_bytes'] / MIB:.1f}",
                    "–" if theirs is None else f"{theirs:g} GB",
                ]
            )
    lines += markdown_table(
        ["model", "C", "device peak", "model states", "checkpoints on host", "paper (40B / 100B)"],
        rows,
    )
    return lines


def _fig8_lines(payload: dict) -> list[str]:
    """Figure 8: the largest batch that fits on each model, and one rank's step there."""
    setup = payload["setup"]
    lines = ["", "## Figure 8: the largest batch that fits, and one rank's step", ""]
    rows = []
    for label, layers in payload["models"].items():
        for n in NAMES:
            p = payload["throughput"][label][_own(payload, n)]
            theirs = paper.FIG8_TFLOPS["60B" if label == "A" else "170B"].get(n)
            if p is None:
                rows.append([f"{label} ({layers} blocks)", n, "✗", "–", "–", _tflops(theirs)])
                continue
            seconds = step_time(p)
            rows.append(
                [
                    f"{label} ({layers} blocks)",
                    n,
                    f"{p['batch']}",
                    f"{seconds:.2f}",
                    f"{p['batch'] * setup['seq'] / seconds:.0f}",
                    _tflops(theirs),
                ]
            )
    lines += markdown_table(
        ["model", "C", "batch", "step s", "tokens/s", "paper TFLOP/s (60B / 170B)"], rows
    )
    return lines


def _tflops(x) -> str:
    return "✗ (did not run)" if x is None else f"{x:g}"


NOTES = (
    "What differs from the paper:",
    "",
    "- No model parallelism: P_a partitions checkpoints over the MP group, so C2 = C1 and",
    "  C4 = C3 here; the paper's C1 → C2 gain (40B → 60B) cannot appear. At MP 16, where",
    "  all five differ: tables/zero_r_mp.md (paper_figures/zero_r_mp.py).",
    "- C5's P_a+cpu becomes checkpoints in host memory (offload_activations). On a CPU-only",
    "  machine they stay in the process: their bytes, counted exactly by the engine, are",
    "  subtracted from the measured RSS peak (measure/budget.py, [Note: measured, not modelled]).",
    "- Every configuration keeps one checkpoint per block, as the paper's runs did.",
    "- Step times are one rank's compute, copies and optimizer: collectives on the fake group",
    "  cost nothing, so the paper's communication-bound small batches (C1, C2) do not show.",
    "  On a CPU a larger batch barely raises tokens/s, unlike on a V100.",
)


def run(*, profile: str, out: Outputs) -> list[SummaryRow]:
    return compute_then_render(NAME, compute, render, profile=profile, out=out)


def index_rows(payload: dict) -> list[list[str]]:
    """INDEX.md rows: Figure 6's largest model ÷ C1's, ours beside the paper's."""
    if "setup" not in payload:
        return []
    prov = payload.get("provenance", {})
    where = f"measured ({prov.get('date_utc', '?')[:10]}), one simulated rank"
    machine = f"CPU, {prov.get('cpu_count', '?')} cores"
    rows = []
    for r in fig6(payload):
        if r["name"] == "C1":
            continue
        rows.append(
            [
                f"Figure 6, largest model {r['name']} ÷ C1's (batch 16/rank)",
                f"{r['paper_vs_c1']:.2f} ({r['paper_billions']}B ÷ 40B, MP 16)",
                f"{r['ours_vs_c1']:.2f}" + (f" (= {r['same_as']}: no MP)" if r["same_as"] else ""),
                f"{r['ours_vs_c1'] / r['paper_vs_c1']:.2f}",
                where,
                machine,
            ]
        )
    return rows
