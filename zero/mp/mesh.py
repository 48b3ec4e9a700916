"""The DP × MP mesh: which ranks share a model-parallel slice, and which a data-parallel group.

Legend (docs/design.md §6):
    N_d   dp, the data-parallel degree (ZeRO's N)
    N_m   mp, the model-parallel (tensor-parallel) degree
    (d, m)  a rank's coordinates: rank = d·N_m + m, 0 <= d < N_d, 0 <= m < N_m

The model-parallel group of rank (d, m) is the N_m adjacent ranks d·N_m .. d·N_m + N_m - 1 (as
Megatron places MP inside a node, where links are fastest); its data-parallel group is the N_d
ranks with the same m, which hold the same slice of the model. ZeRO runs unchanged inside the DP
group on the rank's slice.

``Mesh(dp=2, mp=2).groups()`` creates every group on every rank in one fixed order (all MP
groups by d, then all DP groups by m: ``dist.new_group`` is collective over the world and must be
called identically everywhere) and returns this rank's pair. It works the same under spawn,
torchrun and the fake process group, where one process plays rank (d, m) of the whole mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..materialize import fail, positive_int


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """A data-parallel × model-parallel arrangement of dp·mp ranks."""

    dp: int
    """N_d: data-parallel degree, >= 1."""
    mp: int
    """N_m: model-parallel degree, >= 1 (it must divide n_head and vocab_size of a TP GPT)."""

    def __post_init__(self):
        positive_int("dp", self.dp)
        positive_int("mp", self.mp)

    @property
    def world_size(self) -> int:
        return self.dp * self.mp

    def _check_rank(self, rank: object) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise fail("rank", rank, f"an integer in [0, {self.world_size}) for {self}")

    def coords(self, rank: int) -> tuple[int, int]:
        """(d, m) of a global rank."""
        self._check_rank(rank)
        return divmod(rank, self.mp)

    def rank_of(self, d: int, m: int) -> int:
        """The global rank at coordinates (d, m)."""
        for name, v, hi in (("d", d, self.dp), ("m", m, self.mp)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < hi:
                raise fail(name, v, f"an integer in [0, {hi})")
        return d * self.mp + m

    def mp_ranks(self, d: int) -> list[int]:
        """The model-parallel group of DP index d: adjacent ranks, in m order."""
        return [self.rank_of(d, m) for m in range(self.mp)]

    def dp_ranks(self, m: int) -> list[int]:
        """The data-parallel group of MP index m: stride N_m, in d order."""
        return [self.rank_of(d, m) for d in range(self.dp)]

    def all_groups(self) -> list[tuple[str, int, list[int]]]:
        """Every group of the mesh in creation order: ("mp", d, ranks) for each d, then
        ("dp", m, ranks) for each m."""
        return [("mp", d, self.mp_ranks(d)) for d in range(self.dp)] + [
            ("dp", m, self.dp_ranks(m)) for m in range(self.mp)
        ]

    def groups(self, *, rank: int | None = None) -> MeshGroups:
        """Create every group of the mesh (collective: every rank of the world calls this with
        the same mesh) and return this rank's MP and DP groups.

        The world must have exactly dp·mp ranks. A degree-1 group is still a real group (of one
        rank), so collectives over it are counted and cost nothing.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "Mesh.groups needs an initialised process group (spawn, torchrun, fake)"
            )
        world = dist.get_world_size()
        if world != self.world_size:
            raise fail("world size", world, f"dp·mp = {self.dp}·{self.mp} = {self.world_size}")
        rank = dist.get_rank() if rank is None else rank
        self._check_rank(rank)
        d, m = self.coords(rank)
        mine: dict[str, object] = {}
        for kind, index, ranks in self.all_groups():
            # new_group must run on every rank for every group, in the same order, even for
            # groups this rank is not in (torch.distributed's rule for subgroups).
            group = dist.new_group(ranks)
            if (kind, index) in (("mp", d), ("dp", m)):
                mine[kind] = group
        return MeshGroups(mesh=self, rank=rank, d=d, m=m, mp_group=mine["mp"], dp_group=mine["dp"])


@dataclass(frozen=True, kw_only=True)
class MeshGroups:
    """One rank's place in a mesh and its two process groups."""

    mesh: Mesh
    """The mesh these groups belong to."""
    rank: int
    """This rank's global rank."""
    d: int
    """Its data-parallel index: which replica of the model-parallel slice set it holds."""
    m: int
    """Its model-parallel index: which slice of the split parameters it holds."""
    mp_group: object
    """The N_m ranks (d, 0..N_m-1): the tensor-parallel collectives run here."""
    dp_group: object
    """The N_d ranks (0..N_d-1, m): ZeRO's group (the engine's ``group``)."""
