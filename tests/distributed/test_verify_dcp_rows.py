"""verify's resume rows through DCP (verify/features/dcp.py): saved with save_dcp, loaded with
load_dcp at another N and stage, the saved state read back as plain PyTorch reads the format.
Unplanted they pass bit for bit; `python -m verify.planted --bugs dcp_moments_swapped` shows the
plain-PyTorch read is what catches a format the engine alone would round-trip."""

import pytest

from verify.checkpoints import resume

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def test_the_dcp_resume_rows_pass_bit_for_bit(tmp_path):
    cases = [c for c in resume.resume_cases(quick=True) if "dcp" in c.features]
    assert {(c.n1, c.s1, c.n2, c.s2) for c in cases} == {(2, 1, 4, 3), (4, 3, 1, 0), (4, 3, 2, 1)}
    for i, case in enumerate(cases):
        row = resume.run_case(case, tmp_path / f"case-{i}", timeout_s=300)
        assert row["passed"] and row["checks"] == [], (case.label, row["first_mismatch"])
        plain = row["consolidated"]  # the consolidated read, one step on, as plain PyTorch
        assert plain["state_bitwise"] and plain["next_step_bitwise"], case.label
        assert (tmp_path / f"case-{i}" / "dcp" / ".metadata").is_file()
