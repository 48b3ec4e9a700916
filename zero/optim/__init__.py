"""The optimizer update on flat shards (docs/design.md §2, "Optimizers").

update.py          the update of one step: runs, shards, fast and deterministic paths
native.py          the deterministic update and norm partials as a compiled CPU loop
triton_kernels.py  the same for CUDA as Triton kernels, one launch per unit shard
plain.py           torch.optim's own optimizers with our hyper-parameters (consolidation, peers)
"""
