"""Where P_a+cpu's parts live on a CUDA device (verify/cells/interactions.py's "P_a+cpu × a CUDA
device"): on a CPU host and device are one memory, so only a GPU can show that the offloaded
checkpoint parts are in pinned host memory, that nothing but them left the device, and that
they come back to the device bit for bit.

Checked on the hooks themselves, one process and a process group of one (N_m = 1: the part is
the whole checkpoint): zero/mp/partitioned.py's PartitionedCheckpoints (P_a, with and without
+cpu) and zero/zero_r/activations.py's ActivationOffload (checkpoints offloaded without P_a).
Each copy is counted (kind "offload": d2h down, h2d up) with the part's bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero.common.traffic import CommCounter

pytestmark = pytest.mark.gpu


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one rank on cuda:0 (NCCL); destroyed afterwards."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield dist.group.WORLD
    dist.destroy_process_group()


def checkpoint(numel: int = 1000) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randn(numel, device="cuda", generator=g).view(10, -1)


@pytest.mark.parametrize("offload", [False, True])
def test_p_a_parts_live_on_the_host_with_cpu_and_on_the_device_without(one_rank, offload):
    from zero.mp import MPContext
    from zero.mp.partitioned import PartitionedCheckpoints

    counter = CommCounter()
    hooks = PartitionedCheckpoints(MPContext.of(one_rank, counter=counter), 0, offload=offload)
    t = checkpoint()
    shape, device, numel, part = hooks.pack_hook(t)
    assert (shape, device, numel) == (t.shape, t.device, t.numel())
    if offload:
        assert part.device.type == "cpu" and part.is_pinned()
    else:
        assert part.device == t.device
    back = hooks.unpack_hook((shape, device, numel, part))
    torch.cuda.synchronize()
    assert back.device == t.device
    assert torch.equal(back.view(torch.int32), t.view(torch.int32))
    moved = [(r.op, r.phase, r.nbytes) for r in counter.records if r.kind == "offload"]
    want = [("d2h", "p_a_down", 4000), ("h2d", "p_a_up", 4000)] if offload else []
    assert moved == want


def test_offloaded_checkpoints_live_in_pinned_host_memory(one_rank):
    from zero.zero_r.activations import ActivationOffload

    counter = CommCounter()
    hooks = ActivationOffload(counter, 0)
    t = checkpoint()
    packed = hooks.pack_hook(t)
    host = [x for x in (packed if isinstance(packed, tuple) else (packed,)) if torch.is_tensor(x)]
    assert host and all(h.device.type == "cpu" and h.is_pinned() for h in host)
    back = hooks.unpack_hook(packed)
    torch.cuda.synchronize()
    assert back.device == t.device and torch.equal(back, t)
    assert {r.op for r in counter.records if r.kind == "offload"} == {"d2h", "h2d"}
