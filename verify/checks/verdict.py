"""The named checks of a verification cell (verify/checks/harness.py) and the Verdict they fill.

Each check compares one thing the engine did with what the reference side says it must, and
records its first mismatch under its name (verify.features.CHECKS): structure (units and
groups), reported (loss, norm, skip, scale, step counts), traffic (counted collectives and each
feature's counted bytes), state (bits), bound (fast mode), memory (resident bytes, released
buffers), start (what the engine's start must have cleaned up), raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import features
from .expect import (
    expected_memory,
    expected_released,
    expected_traffic,
    first_difference,
    group_mismatch,
    ran_units,
    traffic_of_step,
)
from .expect_hsdp import ring_next
from .lockstep import gradient_errors
from .sides import CellRun, compare_rank, engine_norm, frozen_unchanged, loss_bound


@dataclass
class StateCheck:
    """Deterministic mode: the engine's master, optimizer states and working copy against the
    reference's, bit for bit (compare_rank), over every step."""

    bitwise: bool = True
    max_abs_diff: float = 0.0
    max_ulp: int = 0


@dataclass
class BoundsCheck:
    """Fast mode: the worst error / derived bound per quantity over every step, with that
    element's error and bound (verify/checks/lockstep.py)."""

    ratios: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def note(self, detail: dict) -> None:
        for key, (r, err, bound) in detail.items():
            if r >= self.ratios.get(key, -1.0):
                self.ratios[key], self.errors[key] = r, (err, bound)


@dataclass
class Verdict:
    """One rank's verdict on one cell, filled by the named checks; `first` is the first
    failure of any of them, and `as_dict` is the record verify/checks/report.py merges over
    ranks."""

    rank: int
    first: str = ""
    failed: bool = False
    skipped_steps: int = 0
    clipped_steps: int = 0  # steps whose clip coefficient was < 1 (clipping did something)
    state: StateCheck = field(default_factory=StateCheck)
    bounds: BoundsCheck = field(default_factory=BoundsCheck)
    # what the engine reported, sent and holds: each the first mismatch, "" when as expected
    reported: str = ""
    traffic: str = ""
    memory: str = ""
    memory_bytes: dict = field(default_factory=dict)
    checks: set = field(default_factory=set)  # the named checks that failed (features.CHECKS)

    def fail(self, why: str, check: str) -> None:
        self.failed = True
        self.first = self.first or why
        self.checks.add(check)

    def note(self, check: str, why: str) -> None:
        """The first mismatch of `check` ("reported", "traffic" or "memory"), if any."""
        if why:
            setattr(self, check, getattr(self, check) or why)
            self.fail(why, check)

    def as_dict(self, mode: str) -> dict:
        first = self.first
        worst = max(self.bounds.ratios.values(), default=0.0)
        checks = set(self.checks)
        if mode == "fast" and worst > 1.0:
            first = first or f"bound exceeded: {self.bounds.ratios}"
            checks.add("bound")
        if not self.state.bitwise:
            checks.add("state")
        bitwise = self.state.bitwise and not self.failed
        passed = (self.first == "" and worst <= 1.0) if mode == "fast" else bitwise
        return {
            "rank": self.rank,
            "bitwise": bitwise,
            "max_abs_diff": self.state.max_abs_diff,
            "max_ulp": self.state.max_ulp,
            "first": first,
            "skipped_steps": self.skipped_steps,
            "clipped_steps": self.clipped_steps,
            "ratios": self.bounds.ratios,
            "errors": self.bounds.errors,
            "reported": self.reported,
            "traffic": self.traffic,
            "memory": self.memory,
            "memory_bytes": self.memory_bytes,
            "passed": passed,
            "checks": sorted(checks),
        }


def _scaler_tuple(scaler):
    return None if scaler is None else (float(scaler.scale), int(scaler.clean_steps))


def check_reported(step: int, eng, res, ref, info, losses, norm_ok) -> str:
    """The step's reported quantities against the reference's: '' or the first mismatch with
    both values. norm_ok(engine norm, reference norm) -> '' or why they differ (mode
    dependent)."""
    want_loss = math.fsum(losses) / len(losses)
    bound = loss_bound(losses)
    if not abs(res.loss - want_loss) <= bound:
        return (
            f"step {step}: loss: engine {res.loss!r}, reference {want_loss!r} (bound {bound:.3g})"
        )
    pairs = [
        ("skip decision", res.skipped, info.skipped),
        ("loss scale used", res.scale, info.scale),
        ("loss scale after the step", _scaler_tuple(eng.scaler), _scaler_tuple(ref.scaler)),
        ("optimizer step count", eng.t, ref.t),
        ("data step", eng.data_step, ref.data_step),
    ]
    for what, ours, theirs in pairs:
        if ours != theirs:
            return f"step {step}: {what}: engine {ours!r}, reference {theirs!r}"
    steps = eng.param_steps()  # [Note: unused parameters]: t_p of every parameter
    for name in sorted(set(steps) | set(ref.master)):
        ours, theirs = steps.get(name), ref.step_of(name) if name in ref.master else None
        if ours != theirs:
            return f"step {step}: step count of {name!r}: engine {ours!r}, reference {theirs!r}"
    if (res.norm is None) != (info.norm is None):
        return f"step {step}: global norm: engine {res.norm!r}, reference {info.norm!r}"
    if info.norm is not None:
        why = norm_ok(res.norm, float(info.norm))
        if why:
            return f"step {step}: global norm: {why}"
    return ""


def check_structure(run: CellRun, v: Verdict) -> bool:
    """The engine's units and parameter groups are the reference's; False when the units are
    not (nothing else can be compared then)."""
    eng, spec = run.eng, run.spec
    ours = [[(name, tuple(shape)) for name, shape in u] for u in eng.unit_specs()]
    theirs = [[(s.name, tuple(s.shape)) for s in lay.slots] for lay in spec.layouts]
    if ours != theirs:
        v.fail(f"units: engine {ours}, reference {theirs}", "structure")
        return False
    # spec.group_of is verify.checks.expect's GROUPINGS, stated apart from the config's group_of
    why = group_mismatch(dict(eng.group_index), dict(spec.group_of))
    if why:
        v.fail(why, "structure")
    return True


def norm_check(run: CellRun, before, info, grads):
    """norm_ok(engine norm, reference norm) -> "" or why they differ: bits in deterministic
    mode; in fast mode bits against the pinned order applied to the engine's own R (computed
    here, on every rank together) and within Δν of the reference's."""
    if run.cell.mode != "fast":
        return lambda ours, theirs: (
            "" if ours == theirs else f"engine {ours!r}, reference {theirs!r}"
        )
    if info.skipped:
        return lambda ours, theirs: ""  # a skipped step reports no norm on either side
    n = run.eng.world_size
    pinned = engine_norm(run.eng, run.spec, run.rank, n, info.scale)
    d = gradient_errors(run.spec, run.rcfg, before, info, grads, run.ref_cfg)[-1]

    def norm_ok(ours, theirs):
        if ours != pinned:  # bits: the order is pinned in both modes
            return f"engine {ours!r}, the pinned order on its own R gives {pinned!r}"
        if not abs(ours - theirs) <= d:
            return f"engine {ours!r}, reference {theirs!r} (bound {d:.3g})"
        return ""

    return norm_ok


def check_traffic(run: CellRun, step: int, info, grads, before_ran, v: Verdict):
    """The step's counted collectives against expected_traffic; returns which units ran last
    where (the next step's `before_ran`), derived from the data alone."""
    n, counter = run.eng.world_size, run.eng.counter
    traffic = traffic_of_step(counter, counter.step - 1)
    ran = ran_units(run.spec, grads, n, run.rank)
    want = expected_traffic(
        run.ref_cfg,
        run.spec,
        n,
        run.rank,
        forward=not run.cell.injected,
        skipped=info.skipped,
        frozen=run.frozen,
        ran=ran,
        before=before_ran,
    )
    v.note("traffic", first_difference(f"step {step}: traffic", traffic, want))
    for expected in features.traffic_checks():  # every cell: none where the config asks none
        kind, want = expected(run.ref_cfg, run.spec, n, info.skipped)
        ours = {f"{r.op}:u{r.unit}": r.elements for r in counter.of_step(counter.step - 1, kind)}
        v.note("traffic", first_difference(f"step {step}: {kind}", ours, want))
    v.note("traffic", link_mismatch(run, step, counter.of_step(counter.step - 1)))
    return [r[-1] for r in ran]


RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def link_mismatch(run: CellRun, step: int, records) -> str:
    """The step's model bytes per link against the layout alone ([Note: traffic per link]): a
    ring over the world sends everything to the next rank, so with ranks node-major (R per
    node) a node's last rank sends all its bytes across nodes and every other rank none; one
    node keeps them all. With hpz a trainable sharded unit's backward all-gather runs over its
    node's R ranks, all on one node: every byte stays inside (at R = 1 it sends none). With
    shard_group_size the ring is the record's group's: the shard group's, or for the sums
    over replicas the replica group's (verify/checks/expect_hsdp.py's ring_next).
    '' or the first record that differs."""
    n, cfg = run.eng.world_size, run.ref_cfg
    per_node = cfg.ranks_per_node or n
    layouts = run.spec.layouts
    for r in records:  # HSDP: a ring over the record's shard or replica group (expect_hsdp.py)
        across = run.rank // per_node != ring_next(cfg, n, run.rank, r.phase) // per_node
        if r.op == "all_to_all" and r.phase in ("grad_node", "grad_across"):  # qgZ's two hops:
            want = (r.nbytes, 0) if r.phase == "grad_node" else (0, r.nbytes)  # over a node,
        elif r.op not in RING_OPS:  # over one rank of each node
            return f"step {step}: {r.op}:{r.phase}: no ring; the link check knows ring ops only"
        else:
            want = (0, r.nbytes) if across else (r.nbytes, 0)
        node = r.op == "all_gather" and r.phase == "param_bwd" and getattr(cfg, "hpz", False)
        if node and r.unit is not None and r.unit < len(layouts):  # frozen units: after these
            want = (r.nbytes, 0)
        if (r.intra_bytes, r.inter_bytes) != want:
            return (
                f"step {step}: {r.op}:{r.phase} unit {r.unit}: (intra, inter) bytes "
                f"({r.intra_bytes}, {r.inter_bytes}), expected {want} on rank {run.rank} of "
                f"{n} at {per_node} per node"
            )
    return ""


def check_state(run: CellRun, step: int, ref, v: Verdict) -> None:
    """Deterministic mode: this rank's extents, bit for bit."""
    ok, worst_abs, worst_ulp, first = compare_rank(run.eng, ref, run.rcfg, run.spec)
    v.state.bitwise &= ok
    v.state.max_abs_diff = max(v.state.max_abs_diff, worst_abs)
    v.state.max_ulp = max(v.state.max_ulp, worst_ulp)
    if first and not v.first:
        v.first = f"step {step}: {first}"


def check_released(run: CellRun, step: int, v: Verdict) -> None:
    """After every step: which gradient buffers the engine released (release_grads) against
    expected_released, before the next step could write into one released by mistake."""
    released = set(run.eng.released_grads())
    got = [u.name in released for u in run.eng.units]
    expected = expected_released(run.ref_cfg, run.spec, run.device.type)
    if got != expected:
        i = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        v.note("memory", f"step {step}: unit {i}'s gradient buffer released: engine {got[i]}, "
                         f"expected {expected[i]} (release_grads between steps)")  # fmt: skip


def check_memory(run: CellRun, v: Verdict) -> None:
    """After the last step: resident bytes against expected_memory, and frozen parameters
    still the cast start values."""
    memory = {k: b for k, b in run.eng.memory_report().items() if k != "comm_buffers"}
    want = expected_memory(run.ref_cfg, run.spec, run.eng.world_size, run.frozen)
    v.memory_bytes = {"engine": memory, "expected": want}
    v.note("memory", first_difference("resident bytes", memory, want))
    if run.frozen_start is not None:  # frozen parameters: the cast start values, never updated
        why = frozen_unchanged(run.eng, run.eng.module, run.frozen_start)
        if why:
            v.fail(why, "state")
