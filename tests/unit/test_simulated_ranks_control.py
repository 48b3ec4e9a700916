"""paper_figures/model_states/simulated_ranks.py: a control rank that did not fit the machine
(skipped, no RSS numbers) is kept as a skipped cell, and the figures render without a runtime
baseline rather than fail on the missing numbers."""

from __future__ import annotations

import paper_figures.model_states.simulated_ranks as S


def test_a_skipped_control_leaves_no_baseline_and_the_cells_still_render(monkeypatch):
    def cell(psi, n, stage, *, device, vocab, prov):
        config = {"num_params": psi, "world_size": n, "stage": stage, "device": device}
        if (psi, n, stage) == (S.SMALL_PARAMS, 64, 3):  # the control: did not fit here
            return {"kind": "memory.skipped", "config": config, "result": {"reason": "no room"}}
        result = {
            "rss_after_construction": 100, "rss_after_steps": [130], "analytic_model_states": 90,
            "engine_model_states": 90, "config": {"num_params": psi}, "rss_peak": 140,
            "estimate": {"peak": 150},
        }  # fmt: skip
        return {"kind": "memory.measured", "config": config, "result": result,
                "provenance": {"date_utc": "d"}}  # fmt: skip

    monkeypatch.setattr(S, "measure_cell", cell)
    monkeypatch.setattr(S, "machine", lambda prov, device: "m")
    payload = S.compute("quick")
    kinds = [r["kind"] for r in payload["records"]]
    assert "memory.control" not in kinds and kinds[0] == "memory.skipped"
    assert S.runtime_baseline(payload) == {}
    cells = S.measured_cells(payload)
    assert cells
    assert all(c["after_step"] == 130 and c["runtime_baseline"] == 0 for c in cells.values())
