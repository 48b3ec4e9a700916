"""The feature registry (verify/features/): each option declared once, read by every part of
verify. Parsing and refusals, the config a cell's features set, the legacy records of older
reports, the cells and resume rows the features add, and `--features` selecting cells."""

import pytest

from verify import features
from verify.cells import matrix
from verify.cells.cell import Cell, legacy
from verify.checkpoints.resume import ResumeCase, resume_cases
from verify.command.options import parse
from verify.command.section_runs import plan

BASE = dict(stage=2, world_size=2, precision="fp32", optimizer="adam", mode="deterministic")


def test_features_are_canonical_and_read_as_attributes():
    c = Cell(**BASE, features=("bucket_elements=256", "disk", "offload"))
    assert c.features == ("offload", "disk", "bucket_elements=256")  # registry order
    assert c.offload is True and c.disk is True and c.bucket_elements == 256
    assert c.contiguous is False and c.release_grads is None and c.watchdog == "calls"
    cfg = c.zero_config(("layers.0",))
    assert cfg.offload_optimizer and cfg.offload_dir is not None and cfg.bucket_elements == 256
    assert not cfg.activation_checkpointing and cfg.watchdog == "calls"
    with pytest.raises(AttributeError):
        c.ofload  # noqa: B018 - a misspelt name still raises


@pytest.mark.parametrize(
    "given, says",
    [
        (("nope",), "'nope' is not a feature"),
        (("disk",), "'disk' with this cell: the disk tier holds offloaded states"),
        (("bucket_elements",), "allowed is 'bucket_elements=<value>'"),
        (("offload=1",), "allowed is 'offload' without a value"),
        (("bucket_elements=0",), "bucket_elements=0: allowed is an integer >= 1"),
        (("offload", "offload"), "'offload' given twice"),
        (("mp",), "verified in its own section (python -m verify --mp)"),
        (("watchdog=calls",), "'calls' is every cell's"),
        ("offload", "a tuple of names"),
    ],
)
def test_a_bad_feature_is_refused_by_name(given, says):
    with pytest.raises(ValueError, match=rf".*{__import__('re').escape(says)}"):
        Cell(**BASE, features=given)


def test_a_feature_that_changes_the_model_names_the_models_it_takes():
    with pytest.raises(ValueError, match=r"'frozen'.*changes the model \['mlp'\]"):
        Cell(**{**BASE, "model": "gpt"}, features=("frozen",))
    with pytest.raises(ValueError, match=r"model='mlp-frozen': say model='mlp'"):
        Cell(**{**BASE, "model": "mlp-frozen"})
    build, _ = Cell(**BASE, features=("frozen",)).builder()
    frozen = [n for n, p in build().named_parameters() if not p.requires_grad]
    assert frozen == ["layers.1.weight", "layers.1.bias"]


def test_an_older_reports_config_reads_as_todays_cell():
    """Fields of the records before the registry, as Cell.from_config and --baseline read them."""
    old = {**BASE, "offload": True, "disk": False, "checkpointing": True, "contiguous": False,
           "bucket_elements": 512, "release_grads": None, "model": "gpt-dropout"}  # fmt: skip
    new = legacy(dict(old))
    assert new["model"] == "gpt"
    assert new["features"] == ("offload", "checkpointing", "offload_activations",
                               "bucket_elements=512", "dropout")  # fmt: skip
    cell = Cell.from_config({**old, "micro_batches": 4})
    assert cell.offload_activations and cell.dropout and cell.bucket_elements == 512


def test_the_presets_hold_every_features_cells_and_resume_rows():
    quick = {(c.seed, c.features) for c in matrix.quick()[0]}
    for f in features.FEATURES.values():
        for fields in f.quick:
            assert (fields["seed"], features.parse_features(fields["features"])) in quick
    rows = resume_cases(quick=True)
    for f in features.FEATURES.values():
        for _, fields in f.resume:
            assert any(r.features == features.parse_features(fields["features"]) for r in rows)
    case = ResumeCase(n1=2, s1=3, n2=1, s2=1, features=("offload", "disk"))
    assert case.engine_config(1, ()).offload_dir is not None and "disk" in case.label


def test_every_feature_pair_and_bug_is_in_the_plans_readers():
    from verify.cells.interactions import PAIRS
    from verify.cells.observable import BRANCH_PREDICATES, OBSERVABLE
    from verify.planted import BUGS

    for f in features.FEATURES.values():
        assert all(p in PAIRS for p in f.pairs), f.name
        assert all(BUGS[b.name] is b for b in f.bugs), f.name
        assert all(OBSERVABLE[b.name] is b.observable for b in f.bugs if b.kind == "cells")
        assert set(f.branches or {}) <= set(BRANCH_PREDICATES), f.name


def test_features_selects_a_presets_cells_and_refuses_an_unknown_name():
    cells, runs = plan(parse(["--quick", "--features", "disk"]), alone=False)
    assert cells and all(c.disk for c in cells) and runs == []
    # its own cells, and the other features' cells that ask for it too (ZeRO++ beside the tier)
    asking = [d for f in features.FEATURES.values() for d in f.quick if "disk" in d["features"]]
    assert len(cells) == len(asking) > len(features.FEATURES["disk"].quick)
    with pytest.raises(ValueError, match=r"features=\['nope'\]: not in the registry"):
        plan(parse(["--quick", "--features", "nope"]), alone=False)
    grid, _ = plan(
        parse(["--features", "bucket_elements=256", "--stages", "2", "--world-sizes", "2",
               "--models", "mlp", "--precisions", "fp32", "--optimizers", "adam"]),
        alone=False,
    )  # fmt: skip
    assert [c.bucket_elements for c in grid] == [256]
