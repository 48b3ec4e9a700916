"""Hierarchical sharding (ZeroConfig.shard_group_size, zero/stages/hsdp.py; FSDP2's HSDP,
DeepSpeed's MiCS): the model states sharded inside groups of G consecutive ranks, replicated
across the N/G groups, each reduction summed over the replicas. Deterministic mode keeps plain
ZeRO's bits at N (for G a power of two the tree over N ranks is the tree over the groups' trees),
so every deterministic cell with it is bitwise the reference; its collectives (a world of G and
the replicas' sums) are expected by verify.checks.expect (verify/checks/expect_hsdp.py), their
links by the verdict's link check over each record's own group, and its memory, the states of a
world of G, by expected_memory."""

from __future__ import annotations

from .record import Bug, Feature


def _group_size(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"shard_group_size={text}: allowed is an integer >= 1")
    return value


def _needs(c) -> str:
    g = c.shard_group_size
    if c.stage == 0:
        return "hierarchical sharding shards the model states; needs stage 1, 2 or 3"
    if c.world_size % g:
        return f"G={g} must divide the world size {c.world_size}"
    if c.mode == "deterministic" and g & (g - 1):
        return f"G={g}: deterministic mode needs a power of two"
    return ""


def plant_replicas_dropped(p) -> None:
    """The sum over the replicas left out: each group steps on its own groups' gradients."""
    from zero.stages import hsdp

    p.setattr(hsdp.Replicas, "sum", lambda self, x, u, counter, whole: x)


def plant_replicas_over_world(p) -> None:
    """The replicas' partials gathered from the whole world, the replica group's picked out:
    the same bits, but N-1 partials sent instead of K-1 (and a ring over the world)."""
    import torch
    import torch.distributed as dist

    from reference.tree import tree_sum
    from zero import collectives as C
    from zero.stages import hsdp

    real = hsdp.Replicas.sum

    def over_world(self, x, u, counter, whole):
        if not self.deterministic:
            return real(self, x, u, counter, whole)
        n, g = dist.get_world_size(), dist.get_world_size() // self.count
        out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
        tag = {"phase": hsdp.PHASE, "unit": u.index, "kind": "model"}
        C.all_gather(out, x, group=None, counter=counter, padding=0, tag=tag)
        mine = out.view(n, x.numel())[u.part.rank :: g]
        return tree_sum(list(mine.unbind(0)))

    p.setattr(hsdp.Replicas, "sum", over_world)


FEATURE = Feature(
    name="shard_group_size",
    doc="hierarchical sharding (HSDP, MiCS): states sharded in groups of G, replicated across",
    config=lambda value: {"shard_group_size": value},
    parse=_group_size,
    absent=None,
    needs=_needs,
    # stages 1-3 at N = 4, G = 2 in bf16 and fp32 (two micro-steps: the replicas' sum every
    # micro-step), N = 8, G = 4 at stage 3 and 2, and two fast cells
    quick=(
        dict(stage=1, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             features=("shard_group_size=2",), seed=6800),
        dict(stage=2, precision="fp32", optimizer="adam", world_size=4, accumulation=1,
             features=("shard_group_size=2",), seed=6801),
        dict(stage=3, precision="bf16", optimizer="sgd", world_size=4, accumulation=2,
             features=("shard_group_size=2",), seed=6802),
        dict(stage=3, precision="fp32", optimizer="adamw", world_size=8, accumulation=1,
             features=("ranks_per_node=4", "shard_group_size=4"), seed=6803),
        dict(stage=2, precision="bf16", optimizer="adam", world_size=8, accumulation=1,
             features=("shard_group_size=4",), seed=6804),
        dict(stage=2, precision="bf16", optimizer="adamw", world_size=4, accumulation=2,
             mode="fast", features=("shard_group_size=2",), seed=6805),
        # fast at K = 4 with a persistent root: stage 0's all-reduce, then the replicas' whole
        dict(stage=3, precision="fp32", optimizer="sgd", world_size=8, accumulation=2,
             mode="fast", persist_below=300, features=("shard_group_size=2",), seed=6806),
    ),
    resume=(
        # saved by the first group of 2 at N = 4 (stage 3), loaded at N = 2 (G = N: plain)
        ({2, 4}, dict(n1=4, s1=3, n2=2, s2=1, precision="bf16", optimizer="adamw",
                      features=("shard_group_size=2",))),
        # a plain checkpoint (N = 2, G = N) loaded into groups of 2 at N = 4
        ({2, 4}, dict(n1=2, s1=2, n2=4, s2=2, precision="fp32", optimizer="adam",
                      features=("shard_group_size=2",))),
    ),
    branches={"states sharded in groups of G < N": lambda c: (
        c.shard_group_size is not None and c.shard_group_size < c.world_size
    )},
    bugs=(
        Bug(name="hsdp_replicas_dropped", breaks="HSDP's sum over the replicas left out",
            where="HSDP with G < N, deterministic", plant=plant_replicas_dropped, check="state",
            observable=lambda c: (
                c.shard_group_size is not None and c.shard_group_size < c.world_size
                and c.mode == "deterministic"
            )),
        Bug(name="hsdp_replicas_over_world",
            breaks="HSDP's replica partials gathered from the whole world",
            where="HSDP with G < N, deterministic", plant=plant_replicas_over_world,
            check="traffic", observable=lambda c: (
                c.shard_group_size is not None and c.shard_group_size < c.world_size
                and c.mode == "deterministic"
            )),
    ),
)  # fmt: skip
