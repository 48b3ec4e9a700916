"""measure/largest.py's search, without training: the ladder's shapes whose estimate fits the
host budget are tried largest first, and a shape that fails (killed for memory, an error) is
recorded and the next smaller one tried; the parameter count matches the GPT's own."""

from __future__ import annotations

from types import SimpleNamespace

import measure.largest as L
from zero.workloads.models import GPT, GPTConfig


def test_params_of_counts_the_gpt():
    for layers, width in ((2, 256), (3, 512)):
        cfg = GPTConfig(vocab_size=L.VOCAB, block_size=L.BLOCK, n_layer=layers,
                        n_head=width // 128, n_embd=width)  # fmt: skip
        model = GPT(cfg, device="meta")
        assert L.params_of(layers, width) == sum(p.numel() for p in model.parameters())


def test_the_search_tries_the_largest_fitting_shape_first_and_steps_down(monkeypatch):
    tried = []

    def attempt(layers, width, tier, args):
        tried.append((layers, width))
        if len(tried) == 1:
            return {"layers": layers, "width": width, "failed": "killed", "returncode": -9}
        return {"layers": layers, "width": width, "params": L.params_of(layers, width)}

    monkeypatch.setattr(L, "attempt", attempt)
    args = SimpleNamespace(host_gib=20.0)
    budget = 20 * (1 << 30)
    fits = [s for s in L.LADDER if L.params_of(*s) * L.BYTES_PER_PARAM["memory"] <= budget]
    records = L.search("memory", args)
    assert tried == [fits[-1], fits[-2]]  # the largest that fits failed; the next one trained
    assert "failed" in records[0] and "failed" not in records[1]
    beyond = L.LADDER[len(fits)]  # the first shape over the budget is never tried
    assert L.params_of(*beyond) * L.BYTES_PER_PARAM["memory"] > budget
