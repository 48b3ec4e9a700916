"""paper_figures/INDEX.md is committed, so `make repro` must write the same rows on any machine
with the same measurements: no row may carry this run's free memory."""

from pathlib import Path

from paper_figures import index
from paper_figures.model_states import table2_max_model

ROOT = Path(__file__).resolve().parents[2]


def _rows_with(monkeypatch, available_gb: float) -> list:
    reason = (
        f"estimated peak 32.00 GB does not fit: MemAvailable {available_gb:.1f} GB, keeping "
        "2.1 GB headroom"
    )
    monkeypatch.setattr(table2_max_model, "rank_fits_here", lambda: (False, reason))
    return index.table2_rows(table2_max_model.compute("quick"))


def test_table2_rows_do_not_depend_on_the_free_memory(monkeypatch):
    rows = _rows_with(monkeypatch, 24.2)
    assert rows == _rows_with(monkeypatch, 11.7)
    skipped = [r for r in rows if "not measured: a 32 GB rank" in r[4]]
    assert len(skipped) == 4 and all(r[4].endswith("does not fit") for r in skipped)


def test_the_committed_index_names_no_free_memory():
    assert "MemAvailable" not in (ROOT / "paper_figures" / "INDEX.md").read_text()
