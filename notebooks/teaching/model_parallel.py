"""Notebook 07's model parallelism: the mesh drawn, and one rank's memory estimated then measured.

- ``mesh_rows(mesh)``: every rank's coordinates (d, m) and its MP and DP groups
  (zero.mp.Mesh, the rule rank = d·N_m + m).
- ``draw_mesh(ax, mesh)``: the N_d × N_m grid, MP groups as rows, DP groups as columns.
- ``picture(setup, names, layers)``: rank (0, 0)'s bytes by category from the model alone
  (measure.mp_rank.estimate), and, with ``measure=True``, measured: each configuration run on a
  simulated rank in a fresh process (measure.budget.probe: the engine's model states, the host
  checkpoints it counted, the RSS peak over two steps, the MP traffic by phase).
- ``draw_picture(ax, rows)``: the estimate as stacked bars, the measurements as markers.

Legend: N_d DP degree, N_m MP degree, (d, m) a rank's coordinates, L blocks.
"""

from __future__ import annotations

from measure.budget import Setup, configurations, probe
from measure.mp_rank import estimate, measure_together
from zero.mp import Mesh

MIB = 2**20
STACK_STATES = ("params", "grads", "master", "optimizer")
STACK = (
    ("params", "working params"),
    ("grads", "gradients"),
    ("master", "fp32 master"),
    ("optimizer", "optimizer states"),
    ("checkpoints_device", "checkpoints on device"),
)


def mesh_rows(mesh: Mesh) -> list[dict]:
    """Per global rank: (d, m), the ranks of its MP group and of its DP group."""
    return [
        {"rank": r, "d": d, "m": m, "mp_group": mesh.mp_ranks(d), "dp_group": mesh.dp_ranks(m)}
        for r in range(mesh.world_size)
        for d, m in [mesh.coords(r)]
    ]


def draw_mesh(ax, mesh: Mesh):
    """The grid of ranks: row d is an MP group (one model split N_m ways), column m a DP group
    (ZeRO's N_d ranks holding the same slice)."""
    for row in mesh_rows(mesh):
        d, m = row["d"], row["m"]
        ax.add_patch(_box(m, d, color=f"C{m % 10}", alpha=0.35))
        ax.text(m, d, f"{row['rank']}\n({d}, {m})", ha="center", va="center", fontsize=8)
    for d in range(mesh.dp):  # an MP group: a frame around its row
        ax.add_patch(_box((mesh.mp - 1) / 2, d, width=mesh.mp, fill=False, lw=1.5))
    ax.set_xlim(-0.6, mesh.mp - 0.4)
    ax.set_ylim(mesh.dp - 0.4, -0.6)
    ax.set_xticks(range(mesh.mp), [f"m = {m}" for m in range(mesh.mp)])
    ax.set_yticks(range(mesh.dp), [f"d = {d}" for d in range(mesh.dp)])
    ax.set_xlabel("MP index m (a column, one colour: a DP group, ZeRO's N_d ranks)")
    ax.set_ylabel("DP index d (a framed row: an MP group)")
    ax.set_title(f"Mesh(dp={mesh.dp}, mp={mesh.mp}): global rank = d·N_m + m")
    return ax


def _box(x, y, *, width=1.0, **kw):
    from matplotlib.patches import Rectangle

    return Rectangle((x - width / 2 + 0.05, y - 0.45), width - 0.1, 0.9, **kw)


def picture(
    setup: Setup, names, layers: int, *, measure: bool = False, fresh: bool = True
) -> list[dict]:
    """Rank (0, 0)'s bytes for each configuration in `names`: the estimate's categories, and
    with `measure` the engine's model states, counted host checkpoints and MP traffic; with
    `fresh` each configuration in a process of its own (measure.budget.probe, two steps), which
    also gives its device peak (RSS above the baseline, host checkpoints subtracted), else all
    in one process (measure.mp_rank.measure_together: one step each, no peak, seconds less)."""
    confs = {c.name: c for c in configurations(setup.mp)}
    together = measure_together(setup, names, layers) if measure and not fresh else {}
    rows = []
    for name in names:
        row = {"name": name, "layers": layers, **estimate(setup, name, layers)}
        if name in together:
            got = together[name]
            row.update(
                measured_states=sum(got["engine_report"][k] for k in STACK_STATES),
                measured_host=got["activation_host_bytes"],
                p_a_elements=got["mp_traffic"].get("p_a", 0),
                mp_elements=sum(v for k, v in got["mp_traffic"].items() if k != "p_a"),
            )
        elif measure:
            p = probe(setup, confs[name], layers=layers)
            row.update(
                measured_states=p.model_states,
                measured_host=p.activation_host_bytes,
                measured_peak=p.device_peak,
                p_a_elements=p.mp_traffic.get("p_a", 0),
                mp_elements=sum(v for k, v in p.mp_traffic.items() if k != "p_a"),
            )
        rows.append(row)
    return rows


def draw_picture(ax, rows: list[dict], *, title: str):
    """Stacked bars: the estimated categories on the device (MiB); markers, where measured: the
    engine's model states (x) and the host checkpoints it counted (^). The device peak is not
    drawn: at this scale it is mostly the constant a first step costs (kernel workspaces,
    autograd's thread, ~20 MB), which would flatten the bars."""
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label in STACK:
        vals = [r[key] / MIB for r in rows]
        ax.bar(xs, vals, 0.6, bottom=bottom, label=f"{label} (estimated)")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    if "measured_states" in rows[0]:
        ax.scatter(xs, [r["measured_states"] / MIB for r in rows], marker="x", color="k",
                   zorder=3, label="model states (engine, measured)")  # fmt: skip
        ax.scatter(xs, [r["measured_host"] / MIB for r in rows], marker="^", color="C7",
                   zorder=3, label="checkpoints on host (counted, measured)")  # fmt: skip
    ax.set_xticks(xs, [r["name"] for r in rows])
    ax.set_xlabel("configuration")
    ax.set_ylabel("MiB on rank (0, 0)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax
