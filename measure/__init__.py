"""Instruments that measure the ZeRO library from the outside; none of them is part of it.

- ``measure.bench``: step time (and MFU) of our stages beside DDP, ZeroRedundancyOptimizer,
  FSDP2 and DeepSpeed on the same model, data and world size (``python -m measure.bench``);
  ``measure.bench_table`` turns its records into ratios and tables; ``measure.mfu`` counts
  model FLOPs and measures the machine's peak.
- ``measure.fake_rank``: one rank of a large job on a fake process group, measured outside the
  engine (``python -m measure.fake_rank``); ``measure.resident`` is the probe it measures with
  (RSS on CPU, the allocator on CUDA).
- ``measure.budget``: ZeRO-R's C1-C5 configurations under a per-rank memory budget.
- ``measure.fragmentation``: allocator fragmentation with and without contiguous buffers (CUDA).
- ``measure.parts``: what measure.bench and measure.fake_rank are built from (their systems,
  configurations, records and tables), each name also importable from the command's module.

Layering: ``measure`` imports ``reference`` and ``zero``; ``zero`` never imports ``measure``.
"""
