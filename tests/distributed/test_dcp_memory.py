"""What save_dcp and load_dcp hold in memory: the save hands DCP its own memory, chunk by chunk
([Note: DCP writes in place] in zero/checkpoint/dcp_plan.py), and measure/parts/dcp_memory.py's
ranks report their sizes and bounds ([Note: DCP memory bound]). The measured growth itself is
the script's record (docs/checkpoints.md), never asserted here.
"""

import math

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _SerialCpuLoader

from zero.checkpoint.dcp_plan import Chunk, SavePlanner, alone, boxes
from zero.ranks.local import get_pool


def chunks_of_matrix(flat: torch.Tensor, shape, lo: int, hi: int) -> list[Chunk]:
    """Elements [lo, hi) of a `shape` tensor held at flat[lo:hi], as save_chunks cuts them."""
    out = []
    for offsets, sizes, first in boxes(shape, lo, hi):
        view = flat[first - lo : first - lo + math.prod(sizes)]
        out.append(Chunk("w", offsets, sizes, tuple(shape), view))
    return out


def test_alone_is_the_same_memory_under_a_storage_of_its_own_size():
    """alone(view): same values and address, a storage of exactly its bytes, which keeps the
    memory alive when every other reference is gone."""
    base = torch.arange(60, dtype=torch.float32)
    view = base[7:27].view(4, 5)
    got = alone(view)
    assert got.data_ptr() == view.data_ptr() and torch.equal(got, view)
    assert got.untyped_storage().nbytes() == got.nbytes == 80
    assert view.untyped_storage().nbytes() == 240  # what DCP would clone
    del base, view
    assert torch.equal(got, torch.arange(7, 27, dtype=torch.float32).view(4, 5))


def test_dcp_writes_the_save_planners_chunks_without_copying_them():
    """DCP's own CPU loader (what its file writer reads tensors through) yields each chunk the
    save planner resolves at the chunk's own address: nothing copied. The same loader over the
    plain views copies each (so the check can fail)."""
    shape, lo, hi = (6, 7), 5, 33  # a partial row, whole rows, a partial row
    buffer = torch.arange(100, dtype=torch.float32)
    flat = buffer[10 : 10 + hi - lo]
    chunks = chunks_of_matrix(flat, shape, lo, hi)
    assert len(chunks) == 3
    planner = SavePlanner(chunks, {}, {})
    planner.set_up_planner({})
    items = planner.create_local_plan().items

    def addresses(resolve) -> list[tuple[int, int]]:
        loader = _SerialCpuLoader(resolve)
        for item in items:
            loader.add(0, item)
        return [(t.data_ptr(), t.numel()) for t, _ in loader.values()]

    held = [(c.flat.data_ptr(), c.flat.numel()) for c in chunks]
    assert addresses(planner.resolve_data) == held
    views = {(c.key, c.offsets): c.view() for c in chunks}

    def plain(item):
        return views[(item.index.fqn, tuple(item.index.offset))]

    copied = addresses(plain)
    assert [n for _, n in copied] == [n for _, n in held]
    assert all(a != b for (a, _), (b, _) in zip(copied, held))


@pytest.mark.dist
def test_the_memory_measurement_runs_on_a_small_llama(tmp_path):
    """measure/parts/dcp_memory.py's ranks on a small shape: the two ranks together read every
    parameter once; the load reads in place, so with SGD without momentum and no persistent
    buffer its fresh targets are nothing and its bound (two chunks) is below the rank's shard; a
    chunk is at most one unit's shard; each call's record has its fields."""
    from measure.parts import dcp_memory

    args = dcp_memory.parser().parse_args(
        ["--layers", "2", "--width", "64", "--mlp", "128", "--heads", "4", "--kv-heads", "2"]
        + ["--vocab", "256", "--dir", str(tmp_path)]
    )
    dcp_memory.check(args)
    per_rank = get_pool(2).run(dcp_memory.rank_main, args, timeout_s=120)
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert sum(r["load"]["elements_read"] for r in per_rank) == per_rank[0]["params"]
    for r in per_rank:
        assert r["load_targets_bytes"] == 0
        assert r["load_bound"] < r["rank_shard_bytes"]
        assert 0 < r["largest_chunk_bytes"] <= r["largest_unit_shard_bytes"]
        assert r["save_bound"] == r["largest_chunk_bytes"]  # nothing frozen
        assert r["largest_chunk_bytes"] <= r["load_bound"] <= 2 * r["largest_chunk_bytes"]
        fields = {"seconds", "anon_growth", "file_growth", "anon_before", "hwm_growth"}
        assert set(r["save"]) == fields and set(r["load"]) == fields | {"elements_read"}
    summary = dcp_memory.summary(per_rank)
    assert set(summary) == {"save_growth_over_bound", "load_growth_over_bound"}
