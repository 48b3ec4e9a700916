"""Model parallelism: the DP × MP mesh and Megatron-style tensor parallelism for the GPT.

    mesh.py         Mesh(dp=N_d, mp=N_m): rank <-> (d, m), the MP and DP process groups
    collectives.py  the counted MP collectives (kind "mp"), the f and g operators
    layers.py       column- and row-parallel linears, vocabulary-parallel embedding and xent
    gpt.py          TPGPT: GPT's slice on one MP rank; split_state / join_states (exact)
    partitioned.py  P_a: activation checkpoints kept 1/N_m per MP rank, gathered to recompute
    control.py      the engine's MP side: norm mask, the MP control exchange (ZeroEngine(mp=))

Semantics, the error bound against N_m = 1 and the traffic table: docs/design.md §6. ZeRO runs
in ``MeshGroups.dp_group`` on a TPGPT: ``ZeroEngine(tp, config, group=g.dp_group, mp=ctx)``,
with the norm counting replicated parameters once (``gpt.counts_in_norm``). Its checkpoints
(every rank's slice, joined on load at another N_m): zero/checkpoint/mpformat.py.
"""

from .gpt import TPGPT, counts_in_norm, join_states, split_rule, split_state, tp_num_params
from .mesh import Mesh, MeshGroups
from .tp_comm import KIND, MPContext

__all__ = [
    "KIND",
    "MPContext",
    "Mesh",
    "MeshGroups",
    "TPGPT",
    "counts_in_norm",
    "join_states",
    "split_rule",
    "split_state",
    "tp_num_params",
]
