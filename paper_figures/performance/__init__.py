"""The sections on step time and throughput (the paper's Figures 2-4), measured and modelled.

- ``throughput``: step time on CPU/gloo beside DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed;
- ``throughput_mp``: Figure 2's shape at our scale, Megatron against ZeRO at N_m = 1, 2, 4;
- ``gpu_throughput``: step time and MFU on one GPU, from the committed GPU records;
- ``throughput_model``: the performance model of the paper's throughput figures (a library, not
  a section; docs/perfmodel.md);
- ``perf_model``: that model fitted on Figure 4, Figures 2 and 3 held out;
- ``zeropp_model``: that model with two link classes, ZeRO++'s speedup over ZeRO-3 beside the
  speedups ZeRO++ reports (a model, not a measurement).

Each section is registered in ``paper_figures/sections.py``; the records they draw are in
``paper_figures/measured/``.
"""
