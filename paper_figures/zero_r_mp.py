"""C1-C5 with model parallelism (the paper's Figures 6 and 7 at MP = 16), on simulated ranks.

One process plays rank (0, 0) of an N_d × N_m mesh on the fake process group ([Note: simulated
MP rank] in measure/simulate.py): it builds its TPGPT slice, runs ZeRO in its DP group and two
real steps, and is measured from outside (RSS). measure.budget.compare finds each
configuration's largest GPT within a per-rank budget (Figure 6) and the peaks of two fixed
models (Figure 7: A = C1's largest; B = half-way between C3's and C4's largest, like the paper's
100B, which had no C1-C3 bars). With N_m > 1 all five configurations differ: P_a keeps 1/N_m of
each checkpoint (C2, C4), P_a+cpu keeps that part in host memory (C5).

Beside the measurement, ``estimate`` gives the same rank by category from zero.memory (model
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
)
from zero.results import provenance, read_json, write_json

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


def render(payload: dict, out: Outputs) -> tuple[Path, str]:
    """The figure and the table (paper_figures/zero_r_mp_render.py)."""
    from paper_figures.zero_r_mp_render import render as draw

    return draw(payload, out)


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
