"""zero/optim/update.py's deterministic kernels give reference/optim.py's bits: the torch ops in
blocks ([Note: in-place blocks], [Note: correctly rounded sqrt]) and the compiled Adam/AdamW loop
(zero/optim/native.py, [Note: a fused loop with the same roundings]). Hypothesis draws the
shard size (odd sizes, sizes around the block edges), the block size, the step, the values'
scale and the gradient's dtype, for SGD, Adam and AdamW with and without weight decay and
momentum, through each kernel."""

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import optim as ref
from reference.optim import Hyper
from reference.tree import chunk_sumsq as ref_sumsq
from zero.control import chunk_sumsq
from zero.optim import native as optim_native
from zero.optim import triton_kernels as optim_triton
from zero.optim import update as zero_optim
from zero.partition import Run

KERNELS = ["native", "triton", "torch"]


@contextlib.contextmanager
def kernel(name: str):
    """Run the deterministic update through one kernel: the compiled loop must be there when
    asked for (on x86-64 Linux with a C compiler, as here and in CI), or the test would
    check the torch ops twice and call it the loop. "triton" is zero/optim/triton_kernels.py's
    kernel under Triton's interpreter (NumPy on CPU tensors: its operations in its order; tests/gpu
    checks the compiled kernel), installed with the dev extra on x86-64 Linux."""
    saved = optim_native.ENABLED, optim_triton.ENABLED, os.environ.get("TRITON_INTERPRET")
    optim_native.ENABLED, optim_triton.ENABLED = name == "native", name == "triton"
    if name == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        if name == "native" and not optim_native.available():
            pytest.skip("no C compiler or not x86-64: the compiled loop is not built here")
        if name == "triton" and not optim_triton.available("cpu"):
            pytest.skip("Triton is not installed here (pip install -e '.[dev]' on x86-64 Linux)")
        yield
    finally:
        optim_native.ENABLED, optim_triton.ENABLED = saved[:2]
        if saved[2] is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved[2]


@contextlib.contextmanager
def block_size(size: int):
    saved, zero_optim.BLOCK = zero_optim.BLOCK, size
    try:
        yield
    finally:
        zero_optim.BLOCK = saved


CASES = {
    "sgd-plain": ("sgd", Hyper(lr=0.1)),
    "sgd-momentum-wd": ("sgd", Hyper(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd-dampening": ("sgd", Hyper(lr=0.05, momentum=0.8, dampening=0.3)),
    "sgd-nesterov-wd": ("sgd", Hyper(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    "adam": ("adam", Hyper(lr=1e-2)),
    "adam-l2": ("adam", Hyper(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    "adamw": ("adamw", Hyper(lr=1e-2, weight_decay=0.1)),
    "adamw-no-decay": ("adamw", Hyper(lr=3e-3, eps=1e-6, betas=(0.5, 0.9))),
}
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def assert_reference_bits(case: str, n: int, t: int, seed: int, grad_dtype: str) -> None:
    kind, hp = CASES[case]
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    scale = 2.0 ** rng.integers(-12, 12, n)  # gradients over 24 binades
    g_low = torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))
    g_low = g_low.to(GRAD_DTYPES[grad_dtype])  # the reduced gradient in its dtype
    g = g_low.float().numpy()  # exact: every bf16/fp16 value is a float32
    state = {
        k: np.abs(rng.standard_normal(n)).astype(np.float32) for k in ref.state_names(kind, hp)
    }
    if t == 1 and kind != "sgd":
        state = ref.init_state(kind, hp, (n,))
    want_p, want_state = ref.step(kind, p, g, state, hp, t)
    tp = torch.from_numpy(p.copy())
    tstate = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    # through step_shards, as the engine calls it (grad[sl].float() of the reduced gradient)
    shard = zero_optim.Shard(tp, g_low, tstate, [(Run(start=0, stop=n, group=0), t)])
    zero_optim.step_shards(kind, (hp,), [shard], deterministic=True)
    assert np.array_equal(bits(tp.numpy()), bits(want_p)), (case, n, t)
    for k in want_state:
        assert np.array_equal(bits(tstate[k].numpy()), bits(want_state[k])), (case, k)


@pytest.mark.parametrize("kern", KERNELS)
@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(sorted(CASES)),
    block=st.sampled_from([1, 7, 64, 1000]),
    n=st.integers(1, 3000),
    t=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
    grad_dtype=st.sampled_from(sorted(GRAD_DTYPES)),
)
def test_blocks_give_the_reference_bits(kern, case, block, n, t, seed, grad_dtype):
    """Many blocks, a ragged last one, one block larger than the shard: always the reference's
    bits (a small BLOCK puts the block edges where hypothesis can reach them; the compiled
    loop has no blocks, and SGD always takes the torch ops)."""
    with kernel(kern), block_size(block):
        assert_reference_bits(case, n, t, seed, grad_dtype)


@pytest.mark.parametrize("kern", KERNELS)
@pytest.mark.parametrize("case", ["sgd-nesterov-wd", "adam-l2", "adamw"])
def test_the_real_block_size_gives_the_reference_bits(kern, case):
    """The kernel's own BLOCK: two full blocks and an odd remainder."""
    with kernel(kern):
        assert_reference_bits(case, 2 * zero_optim.BLOCK + 12_345, t=4, seed=7, grad_dtype="fp32")


def test_the_loop_runs_where_it_should():
    """The engine's shards take the loop (fp32, contiguous, CPU); a strided view does not, and
    is left untouched for the torch ops."""
    with kernel("native"):
        s = ref.step_scalars("adamw", CASES["adamw"][1], 1)
        p, g, m, v = (torch.ones(10) for _ in range(4))
        assert optim_native.adam("adamw", True, s, p, g, m, v)
        assert not torch.equal(p, torch.ones(10))  # it stepped
        q = torch.ones(20)[::2]
        assert not optim_native.adam("adamw", True, s, q, g, m, v)
        assert torch.equal(q, torch.ones(10))


def test_fused_multiply_add_in_the_loop_is_caught():
    """The check can fail for the loop: built without -ffp-contract=off (and with FMA
    instructions), v·b2 + tmp and m·b1 + tmp round once instead of twice, and some element's
    bits differ from the reference's."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "fma" not in cpuinfo.read_text().split():
        pytest.skip("this processor has no FMA instructions")
    flags = tuple(f for f in optim_native._FLAGS if f != "-ffp-contract=off")
    planted = optim_native._build(flags=(*flags, "-ffp-contract=fast", "-mfma"))
    if planted is None:
        pytest.skip("no C compiler here")
    with kernel("native"):
        saved, optim_native._LIB[:] = list(optim_native._LIB), [planted]
        try:
            with pytest.raises(AssertionError):
                assert_reference_bits("adamw", 3000, 3, 1, "fp32")
        finally:
            optim_native._LIB[:] = saved


def test_a_changed_operation_order_is_caught():
    """The check can fail: Adam's moment update written as m + (g - m)·(1 - b1) (lerp's order,
    the same value in exact arithmetic) gives other bits on some element."""
    original = zero_optim._adam_block

    def lerp_order(kind, hp, s, p, g, m, v, ws):
        m0 = m.clone()
        original(kind, hp, s, p, g, m, v, ws)
        m.copy_(m0 + (g - m0) * s["one_minus_b1"])

    zero_optim._adam_block = lerp_order
    try:
        with kernel("torch"), pytest.raises(AssertionError):
            assert_reference_bits("adamw", 3000, 3, 1, "fp32")
    finally:
        zero_optim._adam_block = original


# -- the norm's chunk partials (zero/control.py's chunk_sumsq) ---------------------------------


def special_values(rng, n):
    """Normal values over a wide range of scales, with signed zeros, subnormals, infinities and
    NaNs sprinkled in: every class of float32 the partials must carry through."""
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    where = rng.integers(0, n, 8)
    x[where] = np.array([0.0, -0.0, 1e-45, -3e-42, np.inf, -np.inf, np.nan, 3e38], np.float32)
    return x


@settings(deadline=None, max_examples=60)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([128, 256, 4096]),
    st.integers(1, 5),
    st.booleans(),
    st.booleans(),
)
def test_chunk_partials_give_the_reference_bits(seed, chunk, chunks, masked, specials):
    """The loop's partials = reference/tree.py's chunk_sumsq bit for bit, with and without a
    keep mask (outside it an element counts as +0), and = zero/control.py's torch ops."""
    rng = np.random.default_rng(seed)
    n = chunk * chunks
    x = special_values(rng, n) if specials else rng.standard_normal(n).astype(np.float32)
    keep = torch.from_numpy(rng.random(n) < 0.7) if masked else None
    want = ref_sumsq(np.where(keep.numpy(), x, np.float32(0)) if masked else x, chunk)
    with kernel("native"):
        got = optim_native.chunk_sumsq(torch.from_numpy(x), chunk, keep)
    with kernel("torch"):
        ops = chunk_sumsq(torch.from_numpy(x), chunk, keep)
    assert got is not None
    assert np.array_equal(got.numpy().view(np.uint64), want.view(np.uint64))
    assert np.array_equal(ops.numpy().view(np.uint64), want.view(np.uint64))


@settings(deadline=None, max_examples=20)
@given(st.integers(0, 2**32 - 1), st.sampled_from([128, 4096]), st.integers(1, 3), st.booleans())
def test_triton_chunk_partials_give_the_reference_bits(seed, chunk, chunks, masked):
    """zero/optim/triton_kernels.py's partials (one program per chunk, its halvings as sums over an
    axis of two) = reference/tree.py's chunk_sumsq bit for bit, under Triton's interpreter."""
    rng = np.random.default_rng(seed)
    n = chunk * chunks
    x = special_values(rng, n)
    keep = torch.from_numpy(rng.random(n) < 0.7) if masked else None
    want = ref_sumsq(np.where(keep.numpy(), x, np.float32(0)) if masked else x, chunk)
    with kernel("triton"):
        got = optim_triton.chunk_sumsq(torch.from_numpy(x), chunk, keep)
    assert got is not None
    assert np.array_equal(got.numpy().view(np.uint64), want.view(np.uint64))


def test_chunk_partials_in_another_order_are_caught():
    """The check can fail: the same squares summed left to right (one accumulator per chunk,
    the obvious loop) give other bits than pairwise halving on some chunk."""
    source = optim_native._SOURCE.replace(
        "for (int64_t h = c / 2; h >= 1; h /= 2)\n            for (int64_t i = 0; i < h; i++)"
        " buf[i] = buf[i] + buf[i + h];",
        "for (int64_t i = 1; i < c; i++) buf[0] = buf[0] + buf[i];",
    )
    assert source != optim_native._SOURCE, "the planted loop did not replace the halving"
    planted = optim_native._build(source=source)
    if planted is None:
        pytest.skip("no C compiler here")
    x = np.random.default_rng(3).standard_normal(4096 * 4).astype(np.float32)
    with kernel("native"):
        saved, optim_native._LIB[:] = list(optim_native._LIB), [planted]
        try:
            got = optim_native.chunk_sumsq(torch.from_numpy(x), 4096, None)
        finally:
            optim_native._LIB[:] = saved
    assert not np.array_equal(got.numpy().view(np.uint64), ref_sumsq(x, 4096).view(np.uint64))


def test_chunk_partials_loop_runs_where_it_should():
    """fp32 contiguous CPU tensors take the loop; a strided view or bf16 does not (None)."""
    with kernel("native"):
        assert optim_native.chunk_sumsq(torch.ones(256), 128, None) is not None
        assert optim_native.chunk_sumsq(torch.ones(512)[::2], 128, None) is None
        assert optim_native.chunk_sumsq(torch.ones(256, dtype=torch.bfloat16), 128, None) is None
        with pytest.raises(ValueError, match="chunk=128"):
            optim_native.chunk_sumsq(torch.ones(200), 128, None)


# -- the launches: fast mode batched, deterministic mode flat on devices ([Note: one update
# launch], [Note: host work flat in Ψ]) -------------------------------------------------------


def _shards(rng, sizes, kind, hp_groups):
    """Flat shards cut into runs that alternate between the groups, as units of a model are."""
    out = []
    for n in sizes:
        cut = [0, n // 3, n // 2, n]
        runs = [
            (Run(start=a, stop=b, group=i % len(hp_groups)), 3)
            for i, (a, b) in enumerate(zip(cut, cut[1:]))
        ]
        states = {
            k: torch.from_numpy(np.abs(rng.standard_normal(n)).astype(np.float32))
            for k in ("exp_avg", "exp_avg_sq")
        }
        master = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        grad = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        out.append(zero_optim.Shard(master, grad, states, runs))
    return out


def _copy(shards):
    return [
        zero_optim.Shard(
            s.master.clone(), s.grad.clone(), {k: v.clone() for k, v in s.states.items()}, s.runs
        )
        for s in shards
    ]


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_fast_mode_batched_over_units_gives_the_bits_of_one_call_per_run(kind):
    """One multi-tensor fused call per (group, t) over every unit's runs = one fused call per
    run, bit for bit (the kernel is elementwise); and it is one call per group, not per run."""
    groups = (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=3e-3))
    batched = _shards(np.random.default_rng(5), [1000, 777, 64], kind, groups)
    single = _copy(batched)
    calls = []
    original = zero_optim.fast_step

    def counted(*a):
        calls.append(len(a[3]))
        return original(*a)

    zero_optim.fast_step = counted
    try:
        zero_optim.step_shards(kind, groups, batched, deterministic=False)
    finally:
        zero_optim.fast_step = original
    assert calls == [6, 3]  # group 0: runs 0 and 2 of three shards; group 1: run 1 of each
    for sh in single:
        for run in sh.runs:
            one = zero_optim.Shard(sh.master, sh.grad, sh.states, [run])
            zero_optim.step_shards(kind, groups, [one], deterministic=False)
    for a, b in zip(batched, single):
        assert torch.equal(a.master.view(torch.int32), b.master.view(torch.int32))
        for k in a.states:
            assert torch.equal(a.states[k].view(torch.int32), b.states[k].view(torch.int32))


def test_updates_are_batched_on_cuda_and_unit_by_unit_on_a_host():
    """update_batches: every unit in one batch where every master is on CUDA; one at a time
    where any master lives on the host (the CPU, offload), so refreshes overlap updates."""
    from types import SimpleNamespace

    def shards(*devices):
        return [SimpleNamespace(master=SimpleNamespace(device=torch.device(d))) for d in devices]

    assert zero_optim.update_batches(shards("cuda:0", "cuda:0", "cuda:0")) == [[0, 1, 2]]
    assert zero_optim.update_batches(shards("cpu", "cpu")) == [[0], [1]]
    assert zero_optim.update_batches(shards("cuda:0", "cpu")) == [[0], [1]]
    assert zero_optim.update_batches([]) == []


def _ops_of_deterministic_step(n: int, kind: str) -> int:
    from measure.hostwork import Counts, torch_work

    hp = CASES[kind][1]
    p, g, m, v = (torch.empty(n, device="meta") for _ in range(4))
    counts = Counts()
    with torch_work(counts):
        zero_optim.deterministic_step(
            CASES[kind][0],
            hp,
            2,
            p,
            g,
            {"exp_avg": m, "exp_avg_sq": v}
            if kind != "sgd-momentum-wd"
            else {"momentum_buffer": m},
        )
    return counts.ops


@pytest.mark.parametrize("kind", ["adamw", "adam-l2", "sgd-momentum-wd"])
def test_torch_ops_off_the_cpu_are_one_pass_per_operation(kind):
    """The torch-op fallback on a device that is not the CPU (CUDA without Triton) runs each
    operation once over the whole run, not once per BLOCK: the same operators at 10^3 and
    10^8 elements. The meta device stands in for CUDA (shapes, no values)."""
    with kernel("torch"):
        small, large = (
            _ops_of_deterministic_step(1000, kind),
            _ops_of_deterministic_step(10**8, kind),
        )
    assert small == large
    assert zero_optim.op_block(torch.empty(10**8, device="meta")) == 10**8
    assert zero_optim.op_block(torch.empty(10**8)) == zero_optim.BLOCK


@contextlib.contextmanager
def planted_triton(tmp_path, old: str, new: str, kernel_name: str):
    """zero/optim/triton_kernels.py with `old` replaced by `new` in place of the real kernel, under
    the interpreter. The planted kernel is a module file of its own: Triton reads a kernel's
    source from its file."""
    source = Path(optim_triton.__file__).read_text()
    planted = source.replace(old, new)
    assert planted != source, "the plant did not change the kernel"
    # a module file of its own: its relative imports made absolute
    planted = planted.replace("from ..", "from zero.").replace("from .", "from zero.optim.")
    path = tmp_path / "planted_triton_kernels.py"
    path.write_text(planted)
    spec = importlib.util.spec_from_file_location("planted_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with kernel("triton"):
        module.tl = importlib.import_module("triton.language")  # the body's `tl`
        saved = getattr(optim_triton, kernel_name), dict(optim_triton._JIT)
        optim_triton._JIT.clear()
        setattr(optim_triton, kernel_name, getattr(module, kernel_name))
        try:
            yield
        finally:
            setattr(optim_triton, kernel_name, saved[0])
            optim_triton._JIT.clear()
            optim_triton._JIT.update(saved[1])


def test_a_contracted_multiply_add_in_the_triton_kernel_is_caught(tmp_path):
    """The check can fail for the Triton kernel: v·b2 + tmp computed with one rounding (what
    an FMA would do, here through float64 in the interpreter) gives other bits somewhere."""
    b2 = "tl.load(sc + 4)"
    fma = f"    v = (v.to(tl.float64) * {b2} + tmp.to(tl.float64)).to(tl.float32)\n"
    with planted_triton(tmp_path, f"    v = v * {b2}\n    v = v + tmp\n", fma, "_adam_kernel"):
        with pytest.raises(AssertionError, match="adamw"):  # the bits, not an error
            assert_reference_bits("adamw", 3000, 3, 1, "fp32")


def test_triton_chunk_partials_in_another_tree_are_caught(tmp_path):
    """The check can fail for the Triton partials: neighbours paired (x_0 + x_1, ...), a
    balanced tree too but not the reference's halving, give other bits on some chunk."""
    halving = "tl.split(tl.permute(tl.reshape(s, (2, C >> (b + 1))), (1, 0)))"
    neighbours = "tl.split(tl.reshape(s, (C >> (b + 1), 2)))"
    x = np.random.default_rng(3).standard_normal(4096 * 4).astype(np.float32)
    with planted_triton(tmp_path, halving, neighbours, "_sumsq_kernel"):
        got = optim_triton.chunk_sumsq(torch.from_numpy(x), 4096, None)
    want = ref_sumsq(x, 4096)
    assert got is not None and got.shape == want.shape
    assert not np.array_equal(got.numpy().view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_one_triton_launch_per_unit_gives_each_run_its_own_step(kind):
    """The unit-shard kernel: runs of two groups (one without weight decay) at two step counts,
    with a gap (a parameter without a gradient) between them, in one launch: each run = the
    reference's step with its own hyper-parameters and t_p, the gap's bits untouched."""
    rng = np.random.default_rng(11)
    n = 5000
    groups = (Hyper(lr=1e-2, weight_decay=0.1), Hyper(lr=3e-3, betas=(0.8, 0.99)))
    cuts = [(0, 1300, 0, 3), (1300, 2100, 1, 3), (2600, 4000, 0, 1), (4000, n, 1, 5)]
    p = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 10, n)).astype(np.float32)
    st = {k: np.abs(rng.standard_normal(n)).astype(np.float32) for k in ("exp_avg", "exp_avg_sq")}
    want_p, want = p.copy(), {k: v.copy() for k, v in st.items()}
    for a, b, group, t in cuts:
        sl = slice(a, b)
        want_p[sl], new = ref.step(
            kind, p[sl], g[sl], {k: v[sl] for k, v in st.items()}, groups[group], t
        )
        for k in new:
            want[k][sl] = new[k]
    tp = torch.from_numpy(p.copy())
    ts = {k: torch.from_numpy(v.copy()) for k, v in st.items()}
    runs = [(Run(start=a, stop=b, group=group), t) for a, b, group, t in cuts]
    with kernel("triton"):
        launched = []
        original = optim_triton.adam_runs
        optim_triton.adam_runs = lambda *a: launched.append(len(a[1])) or original(*a)
        try:
            zero_optim.step_shards(
                kind,
                groups,
                [zero_optim.Shard(tp, torch.from_numpy(g), ts, runs)],
                deterministic=True,
            )
        finally:
            optim_triton.adam_runs = original
    assert launched == [4]  # one launch, four runs
    assert np.array_equal(bits(tp.numpy()), bits(want_p))
    assert np.array_equal(bits(tp.numpy()[2100:2600]), bits(p[2100:2600]))  # the gap
    for k in want:
        assert np.array_equal(bits(ts[k].numpy()), bits(want[k])), k
