"""Stage 3 without the whole model: meta construction, unit by unit, and simulated ranks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.loop import train_steps
from zero.ranks.local import get_pool
from zero.workloads.models import GPT, GPTConfig, gpt_config_for, gpt_microbatches, gpt_num_params

REPO = Path(__file__).resolve().parents[2]
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


@pytest.mark.parametrize("target", [3.7e6, 1.2e8, 1.5e9, 7.5e9, 128e9, 1e12])
def test_gpt_config_for_reports_the_exact_count(target):
    vocab = 256 if target < 1e7 else 50257
    cfg, count = gpt_config_for(target, vocab_size=vocab)
    assert GPT(cfg, device="meta").num_params() == count == gpt_num_params(cfg)
    # layers are rounded to the nearest whole block: |count - target| <= half a block
    h = cfg.n_embd
    assert abs(count - target) <= (12 * h * h + 13 * h) / 2


def test_gpt_config_for_rejects_what_cannot_fit():
    with pytest.raises(ValueError, match="num_params=2e\\+06: smaller than the embeddings"):
        gpt_config_for(2e6)


def build_and_train(rank, n, meta):
    model = GPT(SMALL, device="meta" if meta else "cpu", seed=0)
    cfg = ZeroConfig(
        stage=3, precision="bf16", micro_batches=2 * n, chunk=128, units=tuple(model.unit_names())
    )
    eng = ZeroEngine(model, cfg, device="cpu", init_seed=0)
    with eng.gathered_params():
        start = {k: p.detach().clone().view(torch.int16) for k, p in model.named_parameters()}

    def mb(s, j):
        return gpt_microbatches(SMALL, seed=0, data_step=s, count=j + 1, batch_size=2)[j]

    train_steps(eng, mb, 2)
    tied = model.lm_head.weight is model.transformer.wte.weight
    return start, [u.master.clone().view(torch.int32) for u in eng.units], tied


@pytest.mark.dist
def test_meta_construction_gives_the_same_bits_as_a_plain_model():
    """Each unit is materialised from (seed, parameter name) alone: the same working copy as a
    model built whole, and the same bits after two training steps; the head stays tied."""
    built = get_pool(2).run(build_and_train, False)
    meta = get_pool(2).run(build_and_train, True)
    for (start_a, master_a, _), (start_b, master_b, tied) in zip(built, meta, strict=True):
        assert tied
        assert all(torch.equal(start_a[k], start_b[k]) for k in start_a)
        assert all(torch.equal(a, b) for a, b in zip(master_a, master_b, strict=True))


def count_full_units_during_construction(rank, n):
    from zero.stages import stage3

    seen = []
    original = stage3.Stage3.allocate

    def allocate(self, u):
        # full working buffers alive (storage not freed) when this unit is allocated
        units = [*self.units, u]  # the stage's units so far, and this one
        seen.append(sum(x.working.untyped_storage().nbytes() > 0 for x in units))
        return original(self, u)

    stage3.Stage3.allocate = allocate
    try:
        model = GPT(SMALL, device="meta")
        ZeroEngine(
            model,
            ZeroConfig(stage=3, micro_batches=n, chunk=128, units=tuple(model.unit_names())),
            device="cpu",
        )
    finally:
        stage3.Stage3.allocate = original
    return seen


@pytest.mark.dist
def test_construction_holds_one_full_unit_at_a_time():
    for seen in get_pool(2).run(count_full_units_during_construction):
        assert len(seen) == 1 + SMALL.n_layer and max(seen) == 1


SIMULATED_RANK = """
import json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
torch.set_num_threads(1)
n, rank = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.workloads.models import GPT, GPTConfig, gpt_microbatches
from zero.loop import train_steps
cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)
model = GPT(cfg, device="meta")
eng = ZeroEngine(model, ZeroConfig(stage=3, precision="bf16", reduce_dtype="bf16",
                 optimizer="adam", micro_batches=n, chunk=128, nonfinite="skip",
                 units=tuple(model.unit_names())), device="cpu", init_seed=None)
batch = gpt_microbatches(cfg, seed=0, data_step=0, count=1, batch_size=2)[0]
train_steps(eng, lambda s, j: batch, 1)
print(json.dumps({"memory": eng.memory_report(), "counts": eng.counter.counts(0),
                  "padded": sum(u.part.padded_numel for u in eng.units),
                  "units": len(eng.units)}))
"""


@pytest.mark.parametrize("n, rank", [(64, 5), (1024, 1000)])
def test_a_simulated_rank_of_a_large_world(n, rank):
    """One process acts as rank r of an N-rank job (a fake process group: collectives keep
    shapes, values are meaningless), builds only its shards from a meta model, and runs a real
    step. Its resident bytes equal the analytic model at stage 3 exactly, category by category."""
    from zero.common.memory import model_state_breakdown

    done = subprocess.run(
        [sys.executable, "-c", SIMULATED_RANK, str(n), str(rank)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want = model_state_breakdown(
        num_params=got["padded"],
        world_size=n,
        stage=3,
        param_bytes=2,
        grad_bytes=2,
        master_bytes=4,
        optimizer_states=2,
    )
    for key in ("params", "grads", "master", "optimizer"):
        assert got["memory"][key] == getattr(want, key), key
    non_root = got["units"] - 1  # per micro-step: 2 gathers per block, 1 for the root
    assert got["counts"] == {"all_gather": 2 * non_root + 1, "reduce_scatter": got["units"]}


def test_simulate_cli_records_measurements(tmp_path):
    """python -m measure.fake_rank: a rank of a 64-rank world at stage 3, one real step; the record
    carries the measured RSS beside the analytic model states, which the engine's own
    accounting equals exactly. (RSS is not asserted: large zero-filled buffers need not be
    resident until written; the 7.5B measurement is in the README.)"""
    out = tmp_path / "sim.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "measure.fake_rank",
            "--params",
            "3e7",
            "--world-size",
            "64",
            "--stage",
            "3",
            "--steps",
            "1",
            "--seq",
            "16",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rec = json.loads(out.read_text())
    res = rec["result"]
    assert rec["kind"] == "simulate.rank" and rec["config"]["world_size"] == 64
    model_states = sum(res["engine_report"][k] for k in ("params", "grads", "master", "optimizer"))
    assert model_states == res["analytic_model_states"]
    assert res["rss_after_steps"][0] > 0 and res["rss_peak"] >= res["rss_after_construction"]
    assert "analytic model states" in done.stdout
