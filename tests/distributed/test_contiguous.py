"""ZeRO-R's M_D on the engine (zero/zero_r/contiguous.py): gradient buffers and activation
checkpoints in pre-allocated contiguous arenas. It changes where bytes live, never the bits.

Multi-process tests use zero.ranks.launch's shared worker pools; the functions they run are module
level so that forked workers can unpickle them by reference.
"""

import pytest
import torch
from engine_tools import OptCell, failures, mlp_engine, one_step, patched, probe_gpt_engine

from measure.fragmentation import fragmentation, indexed, main
from reference.layout import unit_layout
from reference.precision import DTYPES
from zero.config import ZeroConfig
from zero.ranks.local import get_pool
from zero.workloads.models import gpt_microbatches, mlp_microbatches
from zero.zero_r import contiguous as md
from zero.zero_r.activations import saved_activation_bytes

pytestmark = pytest.mark.timeout(600)

B, S, H, HEADS, L = 2, 16, 32, 2, 2  # batch, sequence, hidden, heads, blocks of the probe GPT
OFFLOAD = (("offload_activations", True), ("offload_optimizer", True))


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_non_bool_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=f"contiguous_memory={value!r}: must be True or False"):
        ZeroConfig(contiguous_memory=value)


# -- bits --------------------------------------------------------------------------------------


def gpt_engine(stage, n, k, **kw):
    """The probe GPT (bf16, one unit per block and the root) and its engine, M = N·k."""
    return probe_gpt_engine(stage, n, k, seq=S, hidden=H, heads=HEADS, layers=L, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a 1D float tensor, as integers of its width."""
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16).clone()


def state_bits(eng) -> list[torch.Tensor]:
    """Every unit's resident working parameters, fp32 master and optimizer states, as bits."""
    out = []
    for u in eng.units:
        out.append(bits(eng.working_extent(u)[0]))
        out.append(bits(u.master))
        out += [bits(u.opt[x]) for x in sorted(u.opt)]
    return out


def trained_bits(rank, n, stage, contiguous, options, steps=3, k=2):
    torch.set_num_threads(1)
    model, eng = gpt_engine(
        stage,
        n,
        k,
        activation_checkpointing=True,
        contiguous_memory=contiguous,
        **dict(options),
    )
    for step in range(steps):
        batches = gpt_microbatches(model.cfg, seed=0, data_step=step, count=n * k, batch_size=B)
        for i in range(k):
            _, loss = eng(*batches[i * n + rank])
            eng.backward(loss)
        eng.step()
    return state_bits(eng)


@pytest.mark.dist
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("options", [(), OFFLOAD], ids=["device", "offload"])
def test_contiguous_memory_changes_no_bit(n, options):
    """Deterministic mode, checkpointing on, 3 steps of M/N = 2: the working parameters, the
    master and Adam's states are the same bits with and without contiguous_memory, at every
    stage, also with the checkpoints and the optimizer offloaded (host arenas)."""
    for stage in (0, 1, 2, 3):
        on = get_pool(n).run(trained_bits, stage, True, options)
        off = get_pool(n).run(trained_bits, stage, False, options)
        for rank, (a, b) in enumerate(zip(on, off, strict=True)):
            assert len(a) == len(b) > 0
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), (stage, rank, i)


@pytest.mark.dist
def test_contiguous_cells_are_bitwise_equal_to_the_reference():
    """The same through the verify harness, against reference/ (GPT, every stage, N = 2)."""
    todo = [
        OptCell(
            stage=s,
            world_size=2,
            precision=p,
            optimizer="adamw",
            mode="deterministic",
            model="gpt",
            options=(("activation_checkpointing", True), ("contiguous_memory", True)) + extra,
        )
        for s in (0, 1, 2, 3)
        for p, extra in (("bf16", ()), ("fp16", OFFLOAD))
    ]
    assert failures(2, todo) == []


@pytest.mark.dist
def test_contiguous_fast_cells_stay_within_their_bounds():
    """Fast mode reduces in place in u.grad (stage 0's all-reduce, stage 1's local sum) and
    accumulates reduced shards (stages 2-3): on arena views, still within the derived bounds."""
    todo = [
        OptCell(
            stage=s,
            world_size=2,
            precision="bf16",
            optimizer="adamw",
            mode="fast",
            options=(("activation_checkpointing", True), ("contiguous_memory", True)) + extra,
        )
        for s in (0, 1, 2, 3)
        for extra in ((), (("offload_optimizer", True),))
    ]
    assert failures(2, todo) == []


# -- gradients: one arena ------------------------------------------------------------------------


def grad_layout(rank, n, stage, reduce_dtype, options):
    """One step of the MLP with contiguous_memory; where every gradient buffer lies (byte offset
    into its arena, or None when it is not a view of it) and the memory split, with the same
    engine built without contiguous_memory for comparison."""
    torch.set_num_threads(1)
    got = {}
    for contiguous in (False, True):  # the arena's engine last: it is the one inspected
        model, eng = mlp_engine(
            stage,
            n,
            1,
            precision="bf16",
            reduce_dtype=reduce_dtype,
            optimizer="adam",
            contiguous_memory=contiguous,
            **dict(options),
        )
        one_step(eng, model, rank, n, 1)
        got[contiguous] = eng.memory_split()
    arenas = {"device": eng.grad_arena, "host": eng.host_grad_arena}

    def where(t):
        for name, a in arenas.items():
            if a is not None and a.holds(t):
                return name, t.data_ptr() - a.buffer.data_ptr(), t.nbytes
        return None, None, t.nbytes

    grads = [where(u.grad) for u in eng.units]
    host_grads = [where(u.host_grad) for u in eng.units if u.host_grad is not None]
    sizes = {k: (None if a is None else a.nbytes) for k, a in arenas.items()}
    return grads, host_grads, sizes, got[True], got[False], eng.unit_specs()


def expected_bytes(specs, n, stage, itemsize, persist_below=0):
    """Σ over units of the resident gradient buffer's bytes, from reference/layout.py alone:
    the whole padded unit at stages 0-1 (and for stage-3 persistent units), one shard at 2-3."""
    total = 0
    for spec in specs:
        lay = unit_layout(spec, chunk=128)
        whole = stage < 2 or (stage == 3 and lay.numel <= persist_below)
        total += (lay.padded_numel(n) if whole else lay.shard_numel(n)) * itemsize
    return total


def check_extents(views, size):
    """Non-overlapping, inside [0, size), 256-byte aligned, and together exactly the arena."""
    spans = sorted((off, nbytes) for _, off, nbytes in views)
    assert all(off % md.ALIGN == 0 for off, _ in spans)
    for (a, na), (b, _) in zip(spans, spans[1:], strict=False):
        assert a + na <= b
    assert spans[0][0] == 0 and spans[-1][0] + spans[-1][1] == size


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("reduce_dtype", [None, "bf16"])
def test_every_gradient_buffer_is_a_view_of_one_arena(stage, reduce_dtype):
    """N = 2: every unit's u.grad (the padded unit at stages 0-1, the shard at 2-3) is a view of
    the one device arena, the views tile it without overlap, and its bytes are exactly the sum of
    the units' gradient bytes, computed from the layouts (shards are multiples of C = 128
    elements, >= 256 bytes: no alignment gap). memory_split is the same as without the arena: it
    is counted once, under grads."""
    n = 2
    g = DTYPES[reduce_dtype or "fp32"].itemsize
    for grads, host_grads, sizes, split, plain, specs in get_pool(n).run(
        grad_layout, stage, reduce_dtype, ()
    ):
        want = expected_bytes(specs, n, stage, g)
        assert sizes == {"device": want, "host": None}
        assert {w for w, _, _ in grads} == {"device"} and host_grads == []
        check_extents(grads, want)
        assert split == plain


@pytest.mark.dist
@pytest.mark.parametrize("stage, persist_below", [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1000)])
def test_offloaded_gradient_buffers_come_from_one_host_arena(stage, persist_below):
    """offload_optimizer: the host gradient buffer of every unit's extent is a view of one host
    arena (at stages 2-3 that buffer is u.grad itself, so no device arena exists unless some
    stage-3 unit is persistent: the MLP's layers.0 (816 parameters) and root (196) are below
    1000, layers.1 (2352) is not). Host arena bytes: Σ extent bytes (the whole unit at stage 0
    and for persistent units, the shard otherwise); memory_split unchanged, host grads exactly
    the host arena."""
    n = 2
    options = (("offload_optimizer", True), ("persist_below", persist_below))
    for grads, host_grads, sizes, split, plain, specs in get_pool(n).run(
        grad_layout, stage, None, options
    ):
        host_want = expected_bytes(specs, n, 0 if stage == 0 else 2, 4)
        persistent = [s for s in specs if unit_layout(s, chunk=128).numel <= persist_below]
        if stage == 3:
            host_want += expected_bytes(persistent, n, 0, 4) - expected_bytes(persistent, n, 2, 4)
        device = [s for s in specs if stage < 2 or s in persistent]
        device_want = expected_bytes(device, n, 0, 4) if device else None
        assert sizes == {"device": device_want, "host": host_want}
        assert len(host_grads) == len(specs) and {w for w, _, _ in host_grads} == {"host"}
        check_extents(host_grads, host_want)
        on_device = [v for v in grads if v[0] == "device"]
        assert len(on_device) == len(device)
        if device:
            check_extents(on_device, device_want)
        assert all(w is not None for w, _, _ in grads)
        assert split == plain and split["host"]["grads"] == host_want


# -- activation checkpoints: one arena, reused -----------------------------------------------------


def checkpoint_probe(rank, n, stage, contiguous, options):
    """One micro-step of the probe GPT. Each block's ln_1 sees the block's input twice: in
    forward (the original tensor) and in the recomputation (what the checkpoint gave back).
    Returns, per block and call, (byte offset into the activation arena or None, bytes, whether
    the recomputation's input has the forward input's bits); the arena's bytes; and the bytes
    autograd saved outside the arena (saved_activation_bytes)."""
    torch.set_num_threads(1)
    model, eng = gpt_engine(
        stage, n, 1, activation_checkpointing=True, contiguous_memory=contiguous, **dict(options)
    )
    seen = []
    for i, block in enumerate(model.transformer.h):

        def probe(_m, args, i=i):
            seen.append((i, args[0]))

        block.ln_1.register_forward_pre_hook(probe)
    x, y = gpt_microbatches(model.cfg, seed=0, data_step=rank, count=1, batch_size=B)[0]
    with saved_activation_bytes(eng) as saved:
        _, loss = eng(x, y)
    forward_inputs = {i: t.clone() for i, t in seen}
    eng.backward(loss)
    arena = eng.activation_arena
    calls = []
    for i, t in seen:
        inside = arena is not None and arena.gen.arena.holds(t)
        offset = t.data_ptr() - arena.gen.arena.buffer.data_ptr() if inside else None
        same = torch.equal(bits(t.reshape(-1)), bits(forward_inputs[i].reshape(-1)))
        calls.append((i, offset, t.nbytes, same))
    eng.step()
    stats = None if arena is None else (arena.nbytes, arena.buffers, arena.misses)
    return calls, stats, saved.nbytes


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("options", [(), (("offload_activations", True),)], ids=["dev", "host"])
def test_checkpoints_live_in_the_activation_arena(stage, options):
    """Each block's recomputation reads its input from the arena: slot i at byte i·b·s·h·2
    (bf16; block inputs are b·s·h elements, and 2·16·32·2 bytes are a multiple of 256), the same
    bits as the forward input; the forward itself used the original tensor. The arena holds
    exactly l·b·s·h·2 bytes, one buffer, nothing missed. The checkpoints no longer count among
    the bytes autograd saves outside the arena (device arena), which drop by exactly that much;
    with offload_activations they were host bytes already."""
    n = 2
    slot = B * S * H * 2
    on = get_pool(n).run(checkpoint_probe, stage, True, options)
    off = get_pool(n).run(checkpoint_probe, stage, False, options)
    for (calls, stats, saved), (calls0, stats0, saved0) in zip(on, off, strict=True):
        assert stats == (L * slot, 1, 0) and stats0 is None
        forward, recomputed = calls[:L], sorted(calls[L:])  # backward runs the last block first
        assert len(calls) == 2 * L and [c[0] for c in calls[L:]] == list(range(L))[::-1]
        assert [c[0] for c in forward] == [c[0] for c in recomputed] == list(range(L))
        assert all(c[1] is None for c in forward)
        assert [c[1:] for c in recomputed] == [(i * slot, slot, True) for i in range(L)]
        assert all(c[1] is None and c[3] for c in calls0)
        assert saved == saved0 - (0 if options else L * slot)


def generations(rank, n, stage, contiguous, pattern):
    """Step 0 in one of four orders, then a plain step 1. "plain": forward, backward, forward,
    backward. "dropped": first a forward whose graph is dropped unused. "kept": first a forward
    whose graph stays alive, never used, until the step is over. "interleaved": both forwards
    first (the first graph alive while the second forward runs), then the backwards, last first
    (the sum of two micro-steps is commutative, so the bits are plain's)."""
    torch.set_num_threads(1)
    k = 2
    model, eng = gpt_engine(
        stage, n, k, activation_checkpointing=True, contiguous_memory=contiguous
    )
    for step in range(2):
        b = gpt_microbatches(model.cfg, seed=0, data_step=step, count=n * k, batch_size=B)
        mine = [b[i * n + rank] for i in range(k)]
        kept = None
        if step == 0 and pattern == "interleaved":
            _, first = eng(*mine[0])
            _, second = eng(*mine[1])
            eng.backward(second)
            eng.backward(first)
        else:
            if step == 0 and pattern in ("dropped", "kept"):
                kept = eng(*mine[1])
                if pattern == "dropped":
                    kept = None
            for x, y in mine:
                _, loss = eng(x, y)
                eng.backward(loss)
        eng.step()
        del kept
    arena = eng.activation_arena
    return state_bits(eng), None if arena is None else arena.buffers


def rewind_always(self):
    """A broken generation rule: rewind whatever still points into the buffer."""
    if self.gen is not None:
        self.gen.arena.cursor, self.gen.wanted = 0, 0


def generations_with_a_broken_rule(rank, n, stage, pattern):
    with patched(md.CheckpointArena, begin=rewind_always):
        return generations(rank, n, stage, True, pattern)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_live_graph_keeps_its_checkpoints(stage):
    """[Note: checkpoint generations]: a forward that starts while an earlier graph still holds
    the arena gets a fresh buffer (2 buffers in all), and a dropped graph frees its slots at once
    (1 buffer, reused): the bits are plain training's either way. With the rule broken (always
    rewind) the second forward overwrites the first one's checkpoints and the bits differ, so
    the comparison has teeth. (Stage 3 reshards the root at the end of every backward, so there
    a graph cannot outlive another micro-step's backward and still be used: no "interleaved".)"""
    n = 2
    plain = get_pool(n).run(generations, stage, False, "plain")
    patterns = [("plain", 1), ("dropped", 1), ("kept", 2)]
    if stage < 3:
        patterns.append(("interleaved", 2))
    for pattern, buffers in patterns:
        got = get_pool(n).run(generations, stage, True, pattern)
        for (a, nbuf), (b, _) in zip(got, plain, strict=True):
            assert nbuf == buffers, pattern
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), pattern
    if stage < 3:
        broken = get_pool(n).run(generations_with_a_broken_rule, stage, "interleaved")
        for (a, _), (b, _) in zip(broken, plain, strict=True):
            assert not all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def growth(rank, n, precision):
    """The MLP's two checkpointed units take inputs of 16 and 48 features: the first checkpoint
    sizes the arena too small. (bytes, buffers, misses) after each micro-step; the bits."""
    torch.set_num_threads(1)
    k = 2
    seen = {}
    for contiguous in (True, False):
        model, eng = mlp_engine(
            0,
            n,
            k,
            precision=precision,
            activation_checkpointing=True,
            contiguous_memory=contiguous,
        )
        arena, trace = eng.activation_arena, []
        for step in range(2):
            b = mlp_microbatches(model.cfg, seed=0, data_step=step, count=n * k, batch_size=4)
            for i in range(k):
                _, loss = eng(*b[i * n + rank])
                eng.backward(loss)
                if arena is not None:
                    trace.append((arena.nbytes, arena.buffers, arena.misses))
            eng.step()
        seen[contiguous] = (trace, state_bits(eng))
    return seen


@pytest.mark.dist
@pytest.mark.parametrize("precision, size", [("bf16", 2), ("fp32", 4)])
def test_the_arena_grows_once_when_a_checkpoint_did_not_fit(precision, size):
    """First forward: the arena is 2 units x span(4·16 elements) and the 4·48-element input of
    layers.1 does not fit: kept as a separate tensor, one miss. The next forward gets a buffer
    of span(4·16) + span(4·48) bytes (spans rounded up to 256 bytes) and nothing misses again.
    The bits equal training without the arena."""
    n = 2
    first = -(-4 * 16 * size // 256) * 256
    second = -(-4 * 48 * size // 256) * 256
    for seen in get_pool(n).run(growth, precision):
        trace, on = seen[True]
        assert trace == [(2 * first, 1, 1)] + [(first + second, 2, 1)] * 3
        assert all(torch.equal(x, y) for x, y in zip(on, seen[False][1], strict=True))


# -- the GPU fragmentation report ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, "steps=0"),
        ({"stage": 4}, "stage=4"),
        ({"n_layer": 1.5}, "n_layer=1.5"),
        ({"n_head": 5}, "n_head=5: must divide n_embd=768"),
        ({"vary_seq": 1}, "vary_seq=1"),
        ({"device": "cpu"}, "device='cpu'"),
    ],
)
def test_fragmentation_validates_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fragmentation(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the report runs there")
def test_fragmentation_refuses_without_cuda(capsys):
    """No CUDA, no numbers: a clear error and a non-zero exit status, not a made-up table."""
    with pytest.raises(RuntimeError, match="torch.cuda.is_available\\(\\) is False"):
        fragmentation()
    assert main(["--steps", "1"]) == 2
    err = capsys.readouterr()
    assert "nothing to measure" in err.err and err.out == ""


def test_fragmentation_gives_a_bare_cuda_device_its_index():
    """'cuda' alone is the current device with its index (torch.cuda.set_device refused the bare
    name on the H200: "Expected a torch.device with a specified index"); an index is kept."""
    assert indexed("cuda", lambda: 3) == torch.device("cuda", 3)
    assert indexed("cuda:1", lambda: 3) == torch.device("cuda", 1)
