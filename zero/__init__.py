"""ZeRO, the Zero Redundancy Optimizer (Rajbhandari et al., arXiv 1910.02054), on torch.distributed.

Stages, as in the paper (§5):
- stage 0: plain data parallelism, the baseline every other stage is compared with;
- stage 1: optimizer states partitioned across the data-parallel ranks (P_os);
- stage 2: gradients partitioned as well (P_os+g);
- stage 3: parameters partitioned as well (P_os+g+p), gathered unit by unit when needed.

Collectives are torch.distributed's: NCCL on GPUs, gloo on CPUs. The semantics every stage must
reproduce are defined by the single-process NumPy package ``reference``; ``verify`` checks them.

Modules (most of them arrive later):
- ``zero.memory``: the paper's analytic model of resident model-state bytes per rank. Pure Python.
- ``zero.results``: the one JSON record format, with provenance, for everything measured.

Legend: Ψ = num_params, N_d = world_size (the data-parallel degree), K = the optimizer-state
multiplier (12 for mixed-precision Adam).

Importing ``zero`` does not import torch: the analytic modules must stay usable (and fast to
import) where torch is absent, so submodules import it themselves.
"""
