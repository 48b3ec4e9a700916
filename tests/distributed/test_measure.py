"""Memory measured outside the engine (measure.resident) and simulated ranks (measure.fake_rank).

Legend: Ψ parameters, N = N_d world size, RSS resident set size, MiB = 2^20 bytes.
"""

import pytest
import torch

from measure.fake_rank import estimate_peak_bytes, measure_rank
from measure.resident import (
    PAGE_BYTES,
    MemoryProbe,
    mem_available_bytes,
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
    saved_activations,
)
from zero.common.memory import model_state_breakdown

MiB = 2**20
BUFFER = 64 * MiB
NOISE = 1 * MiB
"""What this single-threaded test process may allocate besides the buffer between two reads of
RSS (Python objects, the tensor's own header): far under a MiB; the buffer is 64 MiB."""


# --- the process's own memory ----------------------------------------------------------------


@pytest.fixture(autouse=True)
def warm():
    """The first torch ops of a process allocate torch's own state (1.5 MB measured): run them
    before any baseline, as MemoryProbe's users do by building the process group first."""
    x = torch.ones(BUFFER // 4)
    x.fill_(2.0)
    del x
    release_free_memory()


def test_rss_sees_a_touched_buffer_and_its_release():
    release_free_memory()
    before = rss_bytes()
    x = torch.ones(BUFFER // 4)  # written, so every page is resident
    during = rss_bytes()
    del x
    release_free_memory()
    after = rss_bytes()
    assert abs((during - before) - BUFFER) <= NOISE + PAGE_BYTES
    assert abs(after - before) <= NOISE


def test_rss_does_not_see_an_untouched_buffer():
    # The caveat of measure.resident's [Note: quiescent RSS]: torch.empty pages are not resident
    # until written, so RSS can fall below an accounting that counts allocations.
    release_free_memory()
    before = rss_bytes()
    x = torch.empty(BUFFER // 4)
    assert rss_bytes() - before <= NOISE
    x.fill_(1.0)
    assert rss_bytes() - before >= BUFFER - NOISE


def test_peak_is_reset_and_sees_a_freed_buffer():
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here: VmHWM cannot be reset")
    release_free_memory()
    start = rss_bytes()
    assert peak_rss_bytes() - start <= NOISE  # the reset brought the peak down to now
    x = torch.ones(BUFFER // 4)
    del x
    release_free_memory()
    assert peak_rss_bytes() - start >= BUFFER - NOISE
    assert rss_bytes() - start <= NOISE


def test_probe_samples_above_its_baseline():
    probe = MemoryProbe(device="cpu")
    x = torch.ones(BUFFER // 4)
    s = probe.sample("with the buffer")
    assert abs(s["bytes"] - BUFFER) <= NOISE + PAGE_BYTES
    assert s["peak"] >= s["bytes"] - NOISE
    del x
    probe.reset_peak()
    assert abs(probe.sample("without")["bytes"]) <= NOISE


def test_probe_rejects_an_unknown_device():
    with pytest.raises(ValueError, match=r"device='tpu' is not allowed: expected 'cpu'"):
        MemoryProbe(device="tpu")


def test_mem_available_is_known_on_linux():
    avail = mem_available_bytes()
    assert avail is None or avail > 0


# --- activations saved for backward ----------------------------------------------------------


def test_saved_activations_counts_inputs_not_parameters_and_views_once():
    w = torch.nn.Parameter(torch.ones(16, 8))
    x = torch.ones(4, 8, requires_grad=True)
    with saved_activations([w]) as saved:
        y = torch.nn.functional.linear(x, w)  # saves x (for w's gradient) and w (excluded)
        z = y * y  # saves y twice: one storage
    z.sum().backward()
    assert saved.nbytes == (4 * 8 + 4 * 16) * 4
    with saved_activations() as all_saved:  # nothing excluded: w counts too
        torch.nn.functional.linear(x, w).sum().backward()
    assert all_saved.nbytes == (4 * 8 + 16 * 8) * 4


def gpt_saved(batch, seq, hidden, layers, checkpointing):
    from paper_figures.activation_memory import saved_bytes

    return saved_bytes(
        batch=batch, seq=seq, hidden=hidden, layers=layers, checkpointing=checkpointing
    )


def test_one_checkpoint_per_layer_is_exactly_bshl_elements():
    # Reentrant checkpointing saves each block's input, b·s·h elements in bf16, and nothing else
    # per layer: the layers' part, saved(2l) - saved(l), is b·s·h·l·2 bytes exactly.
    b, s, h, l = 2, 32, 64, 2
    layers = gpt_saved(b, s, h, 2 * l, True) - gpt_saved(b, s, h, l, True)
    assert layers == b * s * h * l * 2


def test_activations_scale_linearly_in_batch_and_layers():
    # The footnote's claim is the scaling: doubling the batch or the layers doubles the layers'
    # saved bytes exactly (every saved tensor is per sample and per layer).
    def layer_part(b, l):
        return gpt_saved(b, 32, 64, 2 * l, False) - gpt_saved(b, 32, 64, l, False)

    one = layer_part(2, 1)
    assert layer_part(4, 1) == 2 * one
    assert layer_part(2, 2) == 2 * one
    assert one > 12 * 2 * 32 * 64 * 2  # more than the footnote's 12 elements per b·s·h here


# --- simulated ranks, measured outside the engine ---------------------------------------------

SMALL = {"params": 3e7, "vocab_size": 256, "seq": 16, "steps": 1}
CONSTRUCTION_SLACK = 8 * MiB
"""What building an engine adds to RSS besides its buffers, whatever Ψ: the model's and the
engine's Python objects, modules imported lazily, malloc's bookkeeping. A stated budget: 2-3 MB
measured on every rank here, from 0.03 MB to 480 MB of model states. Plus one page of rounding
per buffer (see slack())."""


def slack(result) -> int:
    # params, grads, master, Adam m and v per unit, each rounded up to a page at most
    units = result["config"]["layers"] + 1
    return CONSTRUCTION_SLACK + 5 * units * PAGE_BYTES


def check_rank(n, stage):
    got = measure_rank(world_size=n, stage=stage, **SMALL)
    assert got["ran"], got
    r = got["result"]
    want = model_state_breakdown(num_params=r["padded_params"], world_size=n, stage=stage)
    # the engine's accounting equals the analytic model exactly, category by category
    for key in ("params", "grads", "master", "optimizer"):
        assert r["engine_report"][key] == getattr(want, key), key
    assert r["engine_model_states"] == want.total == r["analytic_model_states"]
    # measured from outside: every engine buffer is written (zeros or copies), so RSS holds it
    measured = r["rss_after_construction"]
    assert -5 * (r["config"]["layers"] + 1) * PAGE_BYTES <= measured - want.total <= slack(r)
    # the peak covers the quiescent point and stays under the estimate that gates large ranks
    est = estimate_peak_bytes(
        params=SMALL["params"], world_size=n, stage=stage, seq=SMALL["seq"], vocab_size=256
    )
    assert measured <= r["construction_peak"] and r["rss_peak"] <= est["peak"]
    return r, want


@pytest.mark.parametrize("n", [2, 64, 1024])
def test_simulated_rank_stage3_memory(n):
    """Rank 0 of an N-rank fake world at stage 3 (30M-parameter GPT): the engine's accounting
    equals the analytic model, and the RSS measured outside the engine is within the stated
    slack of it."""
    r, want = check_rank(n, 3)
    if n == 2:
        # teeth: the next stage's model states (P_os+g at N = 2: Ψ bytes more) lie outside it
        other = model_state_breakdown(num_params=r["padded_params"], world_size=n, stage=2)
        assert other.total - r["rss_after_construction"] > slack(r)


@pytest.mark.full
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_simulated_rank_stages_0_to_2_memory(stage):
    check_rank(2, stage)


def test_measure_rank_skips_what_does_not_fit():
    # A 1T-parameter rank at N = 1 needs 16 TB: refused before a process starts, with a reason.
    got = measure_rank(params=1e12, world_size=1, stage=0, steps=1)
    assert not got["ran"]
    assert "does not fit" in got["reason"] and "GB" in got["reason"]
    assert got["estimate"]["model_states"] == 16 * got["estimate"]["num_params"]  # (2+2+K)Ψ


def test_measure_rank_rejects_unknown_arguments():
    with pytest.raises(ValueError, match="unknown argument"):
        measure_rank(params=3e7, world_size=2, stage=3, steps=1, check_fits=False, colour=1)


_FREED_BLOCKS = """
import json, sys
import torch
from measure.resident import keep_freed_blocks, rss_bytes
took = keep_freed_blocks() if sys.argv[1] == "keep" else None
returned = []
for mib in (24, 64):  # the first block of each size in the process: glibc maps it on its own
    x = torch.ones(mib * 2**20 // 4)  # written: every page resident
    during = rss_bytes()
    del x
    returned.append(during - rss_bytes())
print(json.dumps({"took": took, "returned": returned}))
"""


@pytest.mark.parametrize("mode", ["system", "keep"])
def test_keep_freed_blocks_keeps_blocks_up_to_32_mib(mode):
    """[Note: malloc keeps freed blocks]: a freed 24 MiB tensor goes back to the kernel under
    glibc's defaults and stays in the heap for reuse once keep_freed_blocks() ran; a 64 MiB one,
    over glibc's largest threshold, goes back either way. In a fresh process: mallopt is global."""
    import json
    import subprocess
    import sys

    if sys.platform != "linux":
        pytest.skip("glibc's malloc and /proc/self/statm are Linux's")
    out = subprocess.run(
        [sys.executable, "-c", _FREED_BLOCKS, mode], capture_output=True, text=True, check=True
    )
    res = json.loads(out.stdout)
    small, large = res["returned"]
    assert abs(large - 64 * MiB) <= NOISE  # over 32 MiB: its own mapping, unmapped when freed
    if mode == "keep":
        assert res["took"] is True
        assert small <= NOISE  # kept in the heap
    else:
        assert abs(small - 24 * MiB) <= NOISE  # glibc's default: unmapped, faulted in next time
