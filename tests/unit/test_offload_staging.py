"""[Note: bounded upload staging] (zero/zero_r/offload.py), its CUDA logic checked on a CPU: the
uploads of the updated working copy go through STAGING_SLOTS compute-dtype buffers used in turn,
and a slot is rewritten only after the event recorded behind its previous upload has been
waited on. On CUDA that event is a torch.cuda.Event; here a recorder stands in for it, so the
order of record, wait and rewrite is what the test reads."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zero.common.traffic import CommCounter
from zero.zero_r.offload import STAGING_SLOTS, HostOffload


def offload(log: list) -> HostOffload:
    off = HostOffload(device=torch.device("cpu"), counter=CommCounter(), grad_dtype=torch.float32,
                      compute_dtype=torch.bfloat16)  # fmt: skip

    class Event:
        def __init__(self):
            self.id = len([x for x in log if x[0] == "record"])

        def record(self):
            log.append(("record", self.id))

        def synchronize(self):
            log.append(("wait", self.id))

    off.new_event = Event
    return off


def unit(index: int, numel: int, off: HostOffload):
    off.padding[index] = 0
    g = torch.Generator().manual_seed(index)
    return SimpleNamespace(index=index, master=torch.randn(numel, generator=g))


def test_a_slot_is_rewritten_only_after_its_previous_upload_is_waited_on():
    log: list = []
    off = offload(log)
    units = [unit(i, n, off) for i, n in enumerate((300, 1000, 20, 999))]
    for u in units:
        off._fit_slots(u.master.numel())
    assert [s.numel() for s in off.slots] == [1000] * STAGING_SLOTS  # the largest extent
    outs = [torch.empty(u.master.numel(), dtype=torch.bfloat16) for u in units]
    for u, dst in zip(units, outs, strict=True):
        off.up(u, dst)
        assert torch.equal(dst, u.master.to(torch.bfloat16))  # round to nearest even
    # uploads 0 and 1 fill both slots; upload 2 reuses slot 0 after waiting for upload 0's
    # event, upload 3 slot 1 after upload 1's (without the wait the log has no ("wait", k);
    # with one slot, or a wait on the wrong event, other ids)
    assert log == [("record", 0), ("record", 1), ("wait", 0), ("record", 2), ("wait", 1),
                   ("record", 3)]  # fmt: skip
    assert sum(s.nbytes for s in off.slots) == STAGING_SLOTS * 1000 * 2


def test_fp32_uploads_read_the_master_itself():
    off = HostOffload(device=torch.device("cpu"), counter=CommCounter(), grad_dtype=torch.float32,
                      compute_dtype=torch.float32)  # fmt: skip
    u = unit(0, 10, off)
    off._fit_slots(10)  # place() does not call it in fp32; nothing to stage either way
    off.slots = []
    dst = torch.empty(10)
    off.up(u, dst)
    assert torch.equal(dst, u.master) and off.slots == []
