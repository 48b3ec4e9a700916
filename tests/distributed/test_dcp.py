"""torch.distributed.checkpoint both ways (zero/checkpoint/dcp.py): bitwise resume through DCP at
another N and stage, each rank writing only its own shards and reading only what it holds, plain
PyTorch and FSDP2 reading and writing the same checkpoints, refusals by one line.

Multi-process parts run on zero.ranks.local's shared pools (module-level functions in
tests/helpers/dcp_tools.py); FSDP2 runs in a throwaway world (spawn), so that its device mesh
never reaches a shared pool. The plain-PyTorch side runs here, in one process without a group.
"""

import math
import re
import shutil
import warnings

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers.dcp_cases import HYPERS, Case, compare_states
from tests.helpers.dcp_tools import (
    chunk_owner_errors,
    dcp_run,
    differences,
    fsdp_round,
    interrupted,
    plain_load,
    plain_optimizer,
    plain_save,
    plain_state,
    refusals,
    same_bits,
)
from zero.checkpoint.dcp_plan import EXTRA_KEY, boxes
from zero.ranks.local import get_pool, spawn
from zero.workloads.models import init_parameters

pytestmark = pytest.mark.timeout(600)


def loss_bits(losses) -> list[int]:
    return np.asarray(losses, np.float64).view(np.uint64).tolist()


# -- boxes ---------------------------------------------------------------------------------------


@given(st.lists(st.integers(1, 5), max_size=4), st.data())
def test_boxes_tile_a_flat_range_in_order(shape, data):
    """Any range [lo, hi) of any shape: the boxes, read in order, are exactly lo .. hi-1, each a
    contiguous run starting at its stated flat index, at most 2·d − 1 of them."""
    numel = math.prod(shape)
    lo = data.draw(st.integers(0, numel - 1))
    hi = data.draw(st.integers(lo + 1, numel))
    flat = np.arange(numel).reshape(shape)
    got = boxes(shape, lo, hi)
    runs = [flat[tuple(slice(o, o + s) for o, s in zip(off, size))].ravel() for off, size, _ in got]
    assert np.array_equal(np.concatenate(runs), np.arange(lo, hi))
    assert [r[0] for r in runs] == [first for _, _, first in got]
    assert len(got) <= max(1, 2 * len(shape) - 1)


def test_boxes_of_a_row_range_of_a_matrix():
    """[3, 17) of a 4 × 5 matrix: the end of row 0, rows 1-2 whole, the start of row 3."""
    assert boxes((4, 5), 3, 17) == [((0, 3), (1, 2), 3), ((1, 0), (2, 5), 5), ((3, 0), (1, 2), 15)]
    assert boxes((4, 5), 5, 15) == [((1, 0), (2, 5), 5)]
    assert boxes((), 0, 1) == [((), (), 0)]


# -- resume through DCP, bitwise -----------------------------------------------------------------

CASES = [
    Case(n1=1, s1=0, n2=2, s2=3),
    Case(n1=2, s1=1, n2=4, s2=2, model="gpt"),  # a tied head
    Case(n1=4, s1=3, n2=1, s2=1, model="mlp-uneven", optimizer="sgd", precision="fp32"),
    Case(n1=2, s1=2, n2=2, s2=0, model="mlp-bn", optimizer="adam", precision="fp16"),  # buffers
    Case(n1=2, s1=3, n2=4, s2=3, frozen=True),
]


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_resume_through_dcp_at_another_world_size_and_stage_is_bitwise(case, tmp_path):
    """k steps at (N1, s1), save_dcp; load_dcp at (N2, s2) into a model from another seed; the
    loaded state is the saved one and every later step the uninterrupted run's, bit for bit
    (masters, optimizer states, t, data step, scaler, losses). Each saved chunk lies in the own
    shard of the rank whose file holds it, and each rank reads exactly the elements it holds."""
    k, j, ck = case.steps_before, case.steps_after, tmp_path / "dcp"
    whole = get_pool(case.n1).run(dcp_run, case, case.s1, k + j)[0]
    saved = get_pool(case.n1).run(dcp_run, case, case.s1, k, str(ck))
    resumed = get_pool(case.n2).run(dcp_run, case, case.s2, j, None, str(ck))
    assert compare_states(saved[0]["state"], resumed[0]["loaded"]) == ""
    assert compare_states(whole["state"], resumed[0]["state"]) == ""
    assert loss_bits(resumed[0]["losses"]) == loss_bits(whole["losses"][k:])
    info = resumed[0]["info"]
    assert (info.world_size, info.stage, info.t) == (case.n1, case.s1, saved[0]["state"]["t"])
    assert [r["read"] for r in resumed] == [r["expected"] for r in resumed]
    md = dcp.FileSystemReader(ck).read_metadata()
    owns = [r["own"] for r in saved]
    assert chunk_owner_errors(md, owns) == []
    assert sorted(p.name for p in ck.glob("*.distcp")) == [
        f"__{r}_0.distcp" for r in range(case.n1)
    ]
    if case.n1 > 1:  # the ownership check sees chunks in another rank's file
        assert chunk_owner_errors(md, owns[::-1]) != []


# -- plain PyTorch, both ways --------------------------------------------------------------------


@pytest.mark.dist
def test_plain_pytorch_loads_the_engines_checkpoint_and_the_engine_loads_plain_pytorchs(tmp_path):
    """1. The engine (GPT with a tied head, two groups, AdamW) at N = 2, stage 3 saves; one plain
    process loads it with dcp.load into get_state_dict's flattened dicts and set_state_dict: every
    parameter, exp_avg, exp_avg_sq has the engine's gathered bits, each step count is t_p and
    each group's hyper-parameters are the engine's. 2. That plain model takes one torch.optim
    step and saves with dcp.save; the engine loads it at N = 2, stage 2 with the same bits, t
    from the step counts (no EXTRA_KEY there)."""
    case = Case(n1=2, s1=3, n2=2, s2=2, model="gpt")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    saved = get_pool(2).run(dcp_run, case, 3, 2, str(ours))[0]
    model = case.make_model()
    init_parameters(model, 1)  # other values, so that nothing passes by accident
    opt = plain_optimizer(case, model)
    plain_load(model, opt, ours)
    t = saved["state"]["t"]
    steps = {k.split("/", 1)[1]: t for k in saved["state"] if k.startswith("master/")}
    assert differences(saved["state"], plain_state(model, opt), steps) == []
    for group, hp in zip(opt.param_groups, HYPERS[case.optimizer], strict=True):
        assert (group["lr"], group["weight_decay"], group["eps"]) == (
            hp.lr,
            hp.weight_decay,
            hp.eps,
        )
        assert tuple(group["betas"]) == tuple(hp.betas)
    assert model.lm_head.weight is model.transformer.wte.weight
    flipped = dict(plain_state(model, opt))  # the comparison sees one flipped bit
    w = flipped["master/transformer.wpe.weight"]
    w.view(np.uint32)[0] ^= 1
    assert differences(saved["state"], flipped, steps) == [
        "master/transformer.wpe.weight: bits differ"
    ]

    _, loss = model(*case.microbatches(model)(t, 0))
    loss.backward()
    opt.step()
    plain_save(model, opt, theirs)
    assert EXTRA_KEY not in dcp.FileSystemReader(theirs).read_metadata().state_dict_metadata
    back = get_pool(2).run(dcp_run, case, 2, 0, None, str(theirs))[0]
    assert differences(back["loaded"], plain_state(model, opt), {}) == []
    assert (back["loaded"]["t"], back["loaded"]["data_step"]) == (t + 1, t + 1)
    assert set(back["info"].steps.values()) == {t + 1}


# -- FSDP2 ---------------------------------------------------------------------------------------


@pytest.mark.dist
def test_fsdp2_loads_the_engines_checkpoint_steps_and_the_engine_loads_its_own(tmp_path):
    """FSDP2 (fully_shard on each block and the root, gloo on CPUs) at N = 2 loads the engine's
    checkpoint (N = 2, stage 2) through set_state_dict with the engine's bits, takes one AdamW
    step and saves its own DCP checkpoint; the engine at N = 4, stage 3 loads that with FSDP2's
    bits after the step, and t = the step counts."""
    case = Case(n1=2, s1=2, n2=4, s2=3, model="gpt")
    ours, theirs = tmp_path / "ours", tmp_path / "fsdp"
    saved = get_pool(2).run(dcp_run, case, 2, 2, str(ours))[0]
    fs = spawn(fsdp_round, 2, case, str(ours), str(theirs), timeout_s=300)[0]
    t = saved["state"]["t"]
    steps = {k.split("/", 1)[1]: t for k in saved["state"] if k.startswith("master/")}
    assert differences(saved["state"], fs["loaded"], steps) == []
    assert differences(saved["state"], fs["after"], {}) != []  # the step moved the state
    back = get_pool(4).run(dcp_run, case, 3, 0, None, str(theirs))[0]
    after = {k: v for k, v in fs["after"].items() if not k.startswith("step/")}
    assert differences(back["loaded"], after, {}) == []
    assert back["loaded"]["t"] == t + 1 and set(back["info"].steps.values()) == {t + 1}


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.dist
def test_refusals_name_the_file_or_key_in_one_line_and_change_nothing(tmp_path):
    """A missing or short data file, a folder without .metadata, a weights-only checkpoint, a
    shape that differs, a key the model lacks, another optimizer, a save over an existing folder:
    each refused on every rank with one line naming it, the engine untouched. A save that fails
    on one rank halfway leaves neither the folder nor its temporary folder."""
    case = Case(n1=2, s1=1, n2=2, s2=1)
    good = tmp_path / "good"
    get_pool(2).run(dcp_run, case, 1, 1, str(good))
    missing, short = tmp_path / "missing", tmp_path / "short"
    shutil.copytree(good, missing)
    (missing / "__1_0.distcp").unlink()
    shutil.copytree(good, short)
    data = (short / "__0_0.distcp").read_bytes()
    (short / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    (tmp_path / "empty").mkdir()
    weights = tmp_path / "weights"
    model = case.make_model()
    with warnings.catch_warnings():  # DCP notes that it saves in one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(model.state_dict()), checkpoint_id=str(weights), no_dist=True)
    damaged = {"missing": missing, "short": short, "empty": tmp_path / "empty", "weights": weights}
    damaged = {k: str(v) for k, v in damaged.items()}
    fresh = tmp_path / "out" / "new"
    got = get_pool(2).run(refusals, case, str(good), damaged, str(fresh))
    assert got[0]["unchanged"] and got[1]["unchanged"]
    want = {
        "exists": r"(CheckpointError: save_dcp to .*good failed on rank 0: )?ValueError: "
        r"directory='.*good': exists; allowed is a path that does not exist yet .*",
        "missing": r"CheckpointError: .*missing/__1_0\.distcp: missing shard file \(\.metadata "
        r"places key '.*' in it\)",
        "short": r"CheckpointError: .*short/__0_0\.distcp: \d+ bytes, but \.metadata places "
        r"key '.*' up to byte \d+",
        "empty": r"CheckpointError: .*empty: no \.metadata: not a DCP checkpoint, or a save "
        r"that never finished",
        "weights": r"ValueError: .*weights: key 'state\.layers\.\d\.(weight|bias)\.exp_avg' "
        r"\(model shape \([\d, ]+\)\) is not in the checkpoint \(\d+ keys\)",
        "optimizer": r"ValueError: optimizer='adam': the checkpoint .*good holds the states of "
        r"optimizer='adamw'",
        "shape": r"ValueError: .*good: key 'layers\.\d\.weight': checkpoint shape \(\d+, \d+\), "
        r"model shape \(\d+, \d+\)",
        "model lacks": r"ValueError: .*good: key 'layers\.\d\.bias' \(checkpoint shape \(\d+,\)\) "
        r"is not in the model",
        "failed save": r"CheckpointError: save_dcp to .*new: rank 1: OSError: .*\(planted\)",
    }
    for r in got:
        assert sorted(r["errors"]) == sorted(want)
        for label, pattern in want.items():
            assert "\n" not in r["errors"][label], label
            assert re.fullmatch(pattern, r["errors"][label]), r["errors"][label]
    assert sorted(p.name for p in fresh.parent.iterdir()) == []


def test_same_bits_compares_bits():
    """The helpers' comparison is of bits: -0.0 and 0.0 differ, a NaN equals itself."""
    assert not same_bits(np.float32(-0.0), np.float32(0.0))
    assert same_bits(np.float32("nan"), np.float32("nan"))


@pytest.mark.dist
def test_a_failure_during_the_read_leaves_the_engine_refusing_until_a_good_load(tmp_path):
    """A data file of the right size whose exp_avg_sq chunks are zeroed (unreadable) passes
    every check made before the read and fails during it: every rank raises one line, and the
    partly loaded engine then refuses a step, an eval forward, save_dcp, engine.save and
    engine.load, each with one line naming the checkpoint; a following load_dcp of a good
    checkpoint clears that and gives the state a fresh engine loads, and the engine steps."""
    case = Case(n1=2, s1=1, n2=2, s2=2)
    good, broken = tmp_path / "good", tmp_path / "broken"
    get_pool(2).run(dcp_run, case, 1, 1, str(good))
    shutil.copytree(good, broken)
    md = dcp.FileSystemReader(broken).read_metadata()
    data = bytearray((broken / "__1_0.distcp").read_bytes())
    for index, info in md.storage_data.items():  # rank 1's exp_avg_sq chunks, zeroed
        if index.fqn.endswith(".exp_avg_sq") and info.relative_path == "__1_0.distcp":
            data[info.offset : info.offset + info.length] = bytes(info.length)
    (broken / "__1_0.distcp").write_bytes(bytes(data))
    got = get_pool(2).run(interrupted, case, str(good), str(broken))
    refused = r"CheckpointError: {} refused: load_dcp from .*broken did not finish reading, so "
    refused += r"this engine is partly loaded; load a checkpoint again with load_dcp, or build "
    refused += r"a new engine"
    for r in got:
        assert r["marked"] == str(broken) and r["after"] is None
        assert sorted(r["errors"]) == ["eval", "load", "read", "save", "save_dcp", "step"]
        assert "\n" not in r["errors"]["read"] and "broken" in r["errors"]["read"]
        for label, call in [("step", "forward"), ("eval", "forward"), ("save_dcp", "save")]:
            assert re.fullmatch(refused.format(call), r["errors"][label]), r["errors"][label]
        for label in ("save", "load"):
            assert re.fullmatch(refused.format(label), r["errors"][label]), r["errors"][label]
        assert r["same"] and len(r["losses"]) == 1 and math.isfinite(r["losses"][0])
