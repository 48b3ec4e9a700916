"""`python -m verify.demo` shows what it says: same bits, the analytic bytes, the §2 traffic.

Every expected value is computed here, apart from the demo: the padded sizes from the reference's
layout (reference/layout.py), the bytes from zero.common.memory's analytic model, the traffic from
docs/design.md §2's table at M = N (with the stage-3 root gathered once per micro-step).

Legend: Ψ parameters, Ψ_root the root unit's parameters, N ranks.
"""

import pytest

from reference.layout import model_layout
from verify import demo
from verify.cells.cell import MODELS
from zero.common.memory import bytes_per_param, model_state_breakdown

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

N = 2
TRAFFIC = {0: 2, 1: 2, 2: 2, 3: 3}  # docs/design.md §2, deterministic, M = N, units of Ψ·(N-1)/N


def sizes() -> tuple[int, int, int]:
    """(Ψ, Ψ_root, Σ padded unit sizes at N) of the demo's GPT, from the reference's layout."""
    model = MODELS["gpt"][0]()
    unit_names = list(model.unit_names())
    params = list(model.named_parameters())
    units = [[(n, tuple(p.shape)) for n, p in params if n.startswith(u + ".")] for u in unit_names]
    in_unit = {n for unit in units for n, _ in unit}
    root = [(n, tuple(p.shape)) for n, p in params if n not in in_unit]
    layouts = model_layout([*units, root], chunk=demo.config(0, N, ()).chunk)
    psi = sum(p.numel() for _, p in params)
    psi_root = sum(p.numel() for n, p in params if n not in in_unit)
    return psi, psi_root, sum(lay.padded_numel(N) for lay in layouts)


@pytest.fixture(scope="module")
def rows():
    return demo.run(world_size=N, steps=3)


def test_every_stage_ends_in_stage_0s_bits(rows):
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    assert len({r.digest for r in rows}) == 1
    assert len({r.loss for r in rows}) == 1


def test_resident_bytes_are_the_analytic_model(rows):
    psi, _, padded = sizes()
    assert all(r.num_params == psi and r.padded == padded for r in rows)
    totals = []
    for r in rows:
        want = model_state_breakdown(
            num_params=padded, world_size=N, stage=r.stage, param_bytes=2, grad_bytes=2
        )
        assert r.memory == {
            "params": want.params,
            "grads": want.grads,
            "master": want.master,
            "optimizer": want.optimizer,
        }
        totals.append(sum(r.memory.values()))
    # and so each stage's ratio to stage 0 is the paper's: 1, (4 + 12/N)/16, (2 + 14/N)/16, 1/N
    for stage, total in enumerate(totals):
        assert total / totals[0] == bytes_per_param(N, stage) / 16


def test_traffic_is_the_design_table(rows):
    psi, psi_root, _ = sizes()
    for r in rows:
        saving = psi_root if r.stage == 3 else 0  # the root: one all-gather per micro-step
        assert r.elements == (N - 1) * (TRAFFIC[r.stage] * psi - saving)
    assert [round(r.traffic, 3) for r in rows[:3]] == [2.0, 2.0, 2.0]
    assert 2.5 < rows[3].traffic < 3


def test_the_table_prints_what_was_measured(rows):
    text = demo.table(rows)
    lines = [x for x in text.splitlines() if x.startswith("| ") and x[2].isdigit()]
    assert len(lines) == 4
    for line, r in zip(lines, rows, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == str(r.stage) and cells[2] == "yes"
        assert cells[-1] == f"{TRAFFIC[r.stage]}Ψ"
        assert float(cells[-3]) == round(bytes_per_param(N, r.stage) / 16, 3)
