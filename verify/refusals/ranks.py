"""The refusals section's rows that need a process group (verify/refusals/section.py runs them).

Each runs on every rank of a local pool of N = 1 or 2: an engine built on a wrong model,
config, initialisation rule or world (zero/build.py, zero/engine.py, zero/materialize.py,
zero/mp/), engine calls out of order, saves that must be refused (zero/checkpoint/commit.py,
mpjoin.py) and loads of a checkpoint of another model, optimizer, grouping or world
(zero/checkpoint/reshard.py, format.py). Before its rows each world saves the checkpoints the
rows load and verify/refusals/damage.py damages: N = 1 a small MLP with a frozen layer after one
Adam step ("plain"), N = 2 a tensor-parallel GPT of two slices ("mp"). A row's `make` runs on
every rank; rows at N = 2 fail alike on both ranks (or, for a load, name the rank that failed),
so that no rank waits in a collective for another. Rows are rebuilt on each rank by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from zero.checkpoint import CheckpointError
from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine
from zero.workloads.models import GPT, MLP, GPTConfig, MLPConfig

from ..cells.cell import GROUPS, MODELS
from .hf_rows import hf_rows
from .rows import SMALL_GPT, Refusal, attempt

PLAIN, MP = "plain", "mp"
"""The checkpoints the pools save under the section's directory (see the module docstring)."""
TP_GPT = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def config(model, n: int = 1, **kw) -> ZeroConfig:
    """The section's engine config: Adam in two groups (matrices decayed), stage 2, M = N."""
    base = dict(
        stage=2, optimizer="adam", groups=GROUPS["adam"], group_of=decay_matrices_only,
        micro_batches=n, units=tuple(model.unit_names()), chunk=128,
    )  # fmt: skip
    return ZeroConfig(**{**base, **kw})


def engine(kind: str = "mlp", n: int = 1, *, model=None, **kw) -> ZeroEngine:
    model = MODELS[kind][0]() if model is None else model
    return ZeroEngine(model, config(model, n, **kw))


def train_step(eng: ZeroEngine, kind: str = "mlp") -> None:
    data = MODELS[kind][1]
    cfg = eng.module.cfg
    k = eng.config.micro_batches // eng.world_size
    for x in data(cfg, seed=0, data_step=eng.data_step, count=k, batch_size=4):
        _, loss = eng(*x)
        eng.backward(loss)
    eng.step()


def save_plain(directory: Path) -> None:
    """The "plain" checkpoint: the frozen-layer MLP after one Adam step, at N = 1."""
    eng = engine("mlp-frozen")
    train_step(eng, "mlp-frozen")
    eng.save(directory / PLAIN)


def mp_context(dp: int, mp: int, **kw):
    """(groups, a new MPContext of kw) of this rank's (dp, mp) mesh."""
    from zero.collectives import CommCounter
    from zero.mp import MPContext

    from ..mp.cells import mesh_groups

    g = mesh_groups(dp, mp)
    return g, MPContext.of(g.mp_group, counter=CommCounter(), **kw)


def tp_engine(dp: int, mp: int, *, model_ctx=None, ctx_kw=None, mp_arg=None, **kw):
    """(model, engine) of a tensor-parallel GPT on this rank's (dp, mp) mesh; model_ctx: the
    context the model is built with (default: the engine's); mp_arg: what the engine is
    given as mp= (default: its context)."""
    from zero.mp import TPGPT

    g, ctx = mp_context(dp, mp, **(ctx_kw or {}))
    model = TPGPT.build(GPTConfig(**TP_GPT), model_ctx or ctx, seed=0)
    cfg = config(model, dp, group_of=None, groups=GROUPS["adam"][:1], **kw)
    return model, ZeroEngine(model, cfg, group=g.dp_group, mp=ctx if mp_arg is None else mp_arg)


def save_mp(directory: Path) -> None:
    """The "mp" checkpoint: a tensor-parallel GPT of two slices (N_d = 1, N_m = 2), unstepped."""
    _, eng = tp_engine(1, 2)
    eng.save(directory / MP)


class Bypassed(nn.Module):
    """A unit (`block`) whose forward is never called: its layer is called directly."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def unit_names(self):
        return ["block"]

    def forward(self, x, y):
        out = self.head(torch.tanh(self.block[0](x)))
        return out, nn.functional.mse_loss(out, y)


class HalfSet(nn.Module):
    """Parameters whose initialisation sets only some elements of `w` (none of `b`)."""

    def __init__(self, device=None):
        super().__init__()
        self.b = nn.Parameter(torch.empty(4, device=device))  # before w: the counter gives it
        self.w = nn.Parameter(torch.empty(4, 4, device=device))

    def reset_parameters(self):
        with torch.no_grad():
            self.w[0].zero_()


class MetaBuffer(nn.Module):
    """A meta-device model with a buffer no module can give a value to."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, device="meta")
        self.register_buffer("scale", torch.ones(4, device="meta"))


def _bypassed():
    model = Bypassed()
    eng = ZeroEngine(model, ZeroConfig(units=("block",), chunk=128))
    _, loss = eng(torch.ones(2, 4), torch.zeros(2, 1))
    eng.backward(loss)


def _own_init():
    """A meta model whose own reset_parameters leaves part of a parameter unset; before it a
    layer shared by two containers, a real layer, a layer without bias (each passes)."""
    shared = nn.Linear(4, 4, bias=False, device="meta")
    model = nn.Sequential(
        nn.Sequential(shared), nn.Linear(4, 4), nn.Sequential(shared), HalfSet(device="meta")
    )
    ZeroEngine(model, ZeroConfig(chunk=128), device="cpu", init="own")


def _hook_init():
    def half(m):
        if isinstance(m, HalfSet):
            with torch.no_grad():
                m.w[1].zero_()

    model = HalfSet(device="meta")
    model.reset_parameters = None  # only the hook initialises
    ZeroEngine(model, ZeroConfig(chunk=128), device="cpu", init=half)


def _inject(grads: dict, *, step: bool = False):
    eng = engine("mlp")
    eng.inject_gradients(grads)
    if step:
        eng.step()


def _frozen_all():
    model = MODELS["mlp"][0]().requires_grad_(False)
    ZeroEngine(model, config(model))


def _save_mid_step(directory: Path):
    eng = engine("mlp", micro_batches=2)
    x = MODELS["mlp"][1](eng.module.cfg, seed=0, data_step=0, count=1, batch_size=4)[0]
    _, loss = eng(*x)
    eng.backward(loss)
    eng.save(directory / "mid-step")


def _disk_full(directory: Path):
    """A save that meets a full disk (RLIMIT_FSIZE: EFBIG, as verify/faults/storage.py makes
    one), at a data step already saved: it goes to a fresh directory, fails naming the file,
    and is abandoned. The limit is this rank's soft one, restored after."""
    import resource
    import signal

    eng = engine("mlp")
    eng.save(directory / "full")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        eng.save(directory / "full")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)


def _load(directory: Path, kind: str = "mlp-frozen", *, model=None, name=PLAIN, **kw):
    eng = engine(kind, model=model, **kw)
    eng.load(directory / name)


def _no_rng_entry(directory: Path):
    """The plain checkpoint with its RNG file's entry renamed (re-checksummed): a load at the
    same world size restores the RNG, so it must name the entry it misses."""
    from ..checkpoints.resume import _rechecksum

    copy = directory / "no-rng"
    shutil.copytree(directory / PLAIN, copy, dirs_exist_ok=True)
    step = sorted(copy.glob("step-*"))[-1]
    m = json.loads((step / "manifest.json").read_text())
    entries = m["files"]["r0000.bin"]["entries"]
    entries["rng:other"] = entries.pop("rng:torch_cpu")
    (step / "manifest.json").write_text(json.dumps(_rechecksum(m)))
    _load(directory, name="no-rng")


def _saved_with(directory: Path, attr: str, value):
    """A TP engine's save after its model's `attr` is set to `value` (what a model-parallel
    checkpoint needs from the model, missing or wrong)."""

    def make():
        model, eng = tp_engine(1, 1)
        setattr(model, attr, value)
        eng.save(directory / "never")

    return make


def _tp_forward_too_long():
    model, _ = tp_engine(1, 1)
    model(torch.zeros(1, TP_GPT["block_size"] + 1, dtype=torch.long))


def _mlp(**kw) -> MLP:
    return MLP(MLPConfig(**{**dict(d_in=16, d_hidden=48, d_out=4), **kw}))


def _make_engine(kind="mlp", model=None, **kw):
    return lambda: engine(kind, model=model, **kw)


def _tp_counts_missing():
    from zero.mp import TPGPT

    _, ctx = mp_context(1, 1)
    model = TPGPT.build(GPTConfig(**TP_GPT), ctx, seed=0)
    model.counts_in_norm = None
    ZeroEngine(model, config(model, group_of=None, groups=GROUPS["adam"][:1]), mp=ctx)


def one_rank_rows(directory: Path) -> list[Refusal]:
    """Rows on a pool of one rank, by subject: the engine's construction, its calls and
    initialisation, model parallelism, saves and loads."""
    rows = [*_build_rows(), *_engine_rows(), *_mp_rows(directory), *_checkpoint_rows(directory)]
    hf = hf_rows(directory)  # Refusal rows already (verify/refusals/hf_rows.py)
    return [Refusal(f"{m}: {w}", m, make, e, s, world=1) for m, w, make, e, s in rows] + hf


def _build_rows() -> list[tuple]:
    """The engine built on a wrong module, config, unit list, parameter or grouping."""
    nested = ("transformer.h.0", "transformer.h.0.attn")
    gpt = GPT(GPTConfig(**SMALL_GPT))
    return [
        ("build", "a module that is not an nn.Module",
         lambda: ZeroEngine("mlp", ZeroConfig()), ValueError,
         "module=str: must be a torch.nn.Module"),
        ("build", "a module without parameters", lambda: ZeroEngine(nn.ReLU(), ZeroConfig()),
         ValueError, "module=ReLU: has no parameters"),
        ("build", "a config that is not a ZeroConfig", lambda: ZeroEngine(_mlp(), {"stage": 1}),
         ValueError, "config=dict: must be a zero.ZeroConfig"),
        ("build", "a unit that is not a submodule", _make_engine(units=("nope",)), ValueError,
         "units: 'nope' is not a submodule of the model"),
        ("build", "a container as a unit", _make_engine(units=("layers",)), ValueError,
         "units: 'layers' is an nn.ModuleList"),
        ("build", "nested units", _make_engine(model=gpt, units=nested), ValueError,
         "units: 'transformer.h.0' contains 'transformer.h.0.attn'; nested units"),
        ("zero_r/activations", "nested units checkpointed",
         _make_engine(model=gpt, units=nested, activation_checkpointing=True), ValueError,
         "units: 'transformer.h.0' contains 'transformer.h.0.attn'; activation_checkpointing"),
        ("build", "a float64 parameter", _make_engine(model=MODELS["mlp"][0]().double()),
         ValueError, "parameter 'layers.0.weight' has dtype torch.float64"),
        ("build", "nothing to train", _frozen_all, ValueError,
         "no parameter with requires_grad=True"),
        ("build", "a meta buffer without reset_running_stats",
         lambda: ZeroEngine(MetaBuffer(), ZeroConfig(chunk=128), device="cpu"), ValueError,
         "buffer 'scale' is on the meta device"),
        ("build", "group_of beyond the groups", _make_engine(group_of=lambda name, p: 5),
         ValueError, "group_of('layers.2.weight')=5: allowed are 0..1"),
        ("build", "group_of not an index", _make_engine(group_of=lambda name, p: "0"),
         ValueError, "group_of('layers.2.weight')='0': allowed are 0..1"),
        ("build", "group_of that raises", _make_engine(group_of=lambda name, p: 1 // 0),
         ValueError, "group_of('layers.2.weight') raised ZeroDivisionError"),
        ("build", "a unit whose forward is never called", _bypassed, ValueError,
         "units: the forward of unit 'block' was never called"),
    ]  # fmt: skip


def _engine_rows() -> list[tuple]:
    """The engine's calls out of order or with wrong values, and its initialisation rules."""
    return [
        ("engine", "P_a without model parallelism",
         _make_engine(partition_activations=True, activation_checkpointing=True), ValueError,
         "partition_activations=True: P_a needs model parallelism"),
        ("engine", "a meta model built on meta",
         lambda: ZeroEngine(MODELS["mlp"][0](device="meta"), ZeroConfig(), device="meta"),
         ValueError, "device='meta': a meta-device model needs a real device"),
        ("engine", "a gradient for no parameter", lambda: _inject({"nope": torch.zeros(1)}),
         ValueError, "grads['nope']: no trainable parameter has that name"),
        ("engine", "a gradient of the wrong shape",
         lambda: _inject({"layers.1.bias": torch.zeros(5)}), ValueError,
         "grads['layers.1.bias']: shape (5,) dtype torch.float32; the parameter needs shape (48,)"),
        ("engine", "step() before any backward", lambda: engine("mlp").step(), RuntimeError,
         "step() after 0 micro-steps on rank 0; micro_batches=1 at N=1 needs 1"),
        ("engine", "a non-finite gradient without a scaler",
         lambda: _inject({"layers.1.bias": torch.full((48,), float("inf"))}, step=True),
         FloatingPointError, "non-finite gradient at data step 0"),
        ("materialize", "an unknown init rule",
         lambda: ZeroEngine(MODELS["mlp"][0](device="meta"), ZeroConfig(), device="cpu",
                            init="bogus"), ValueError, "init='bogus': allowed are"),
        ("materialize", "reset_parameters setting part of a parameter", _own_init, ValueError,
         "parameter '3.w' of unit <root>: its module's initialisation (reset_parameters or "
         "init=) set only some of its elements"),
        ("materialize", "an init hook setting part of a parameter", _hook_init, ValueError,
         "parameter 'w' of unit <root>: its module's initialisation"),
    ]  # fmt: skip


def _mp_rows(directory: Path) -> list[tuple]:
    """Model parallelism: the mesh, the MP context, the TP model, and what its saves need."""
    return [
        ("mp/mesh", "a mesh larger than the world", lambda: tp_engine(1, 2), ValueError,
         "world size=1 is not allowed: expected dp·mp = 1·2 = 2"),
        ("mp/step", "mp= not an MPContext", lambda: tp_engine(1, 1, mp_arg="ctx"), ValueError,
         "mp='ctx': must be a zero.mp.MPContext"),
        ("mp/step", "layers holding another MPContext",
         lambda: tp_engine(1, 1, model_ctx=mp_context(1, 1)[1]), ValueError,
         "mp: the module's tensor-parallel layers must hold this same MPContext"),
        ("mp/step", "a fast MP sum in a deterministic engine",
         lambda: tp_engine(1, 1, ctx_kw=dict(deterministic=False)), ValueError,
         "mp.deterministic=False: must equal config.deterministic=True"),
        ("mp/step", "a TP model without counts_in_norm", _tp_counts_missing, ValueError,
         "has no counts_in_norm(name) method"),
        ("mp/gpt", "a TP forward beyond block_size", _tp_forward_too_long, ValueError,
         "sequence length=9 is not allowed: expected at most block_size=8"),
        ("checkpoint/mpjoin", "a TP model without split_rule saved",
         _saved_with(directory, "split_rule", None), ValueError,
         "mp: TPGPT has no split_rule(name) method"),
        ("checkpoint/mpjoin", "an unknown split rule saved",
         _saved_with(directory, "split_rule", lambda name: "diag"), ValueError,
         "split_rule('transformer.wte.weight') = 'diag': expected one of"),
    ]  # fmt: skip


def _checkpoint_rows(directory: Path) -> list[tuple]:
    """Saves that must be refused, and loads of a checkpoint of another model, optimizer,
    grouping or world (the "plain" checkpoint)."""
    return [
        ("checkpoint/commit", "keep_last 0",
         lambda: engine("mlp").save(directory / "never", keep_last=0), ValueError,
         "keep_last=0: must be None or an integer >= 1"),
        ("checkpoint/commit", "extra not JSON",
         lambda: engine("mlp").save(directory / "never", extra={"x": object()}), ValueError,
         "must be JSON-serialisable"),
        ("checkpoint/format", "a save in the middle of a step",
         lambda: _save_mid_step(directory), RuntimeError,
         "save after 1 micro-steps of an unfinished step on rank 0"),
        ("checkpoint/commit", "a full disk mid-save", lambda: _disk_full(directory), OSError,
         f"File too large: '{directory / 'full' / 'step-00000000-1'}/"),
        ("checkpoint/commit", "a root under a regular file",
         lambda: engine("mlp").save(directory / "a-file" / "sub"), OSError,
         str(directory / "a-file" / "sub")),
        ("checkpoint/reshard", "a GPT loading an MLP's checkpoint",
         lambda: _load(directory, model=GPT(GPTConfig(**SMALL_GPT))), ValueError,
         "parameter 'transformer.wte.weight': model shape (64, 32), not in the checkpoint"),
        ("checkpoint/reshard", "a narrower model",
         lambda: _load(directory, model=_mlp(d_hidden=32)), ValueError,
         "parameter 'layers.0.weight': checkpoint shape (48, 16), model shape (32, 16)"),
        ("checkpoint/reshard", "a model missing a layer",
         lambda: _load(directory, model=_mlp(d_out=48, n_layer=2)), ValueError,
         "parameter 'layers.2.weight': checkpoint shape (4, 48), not in the model"),
        ("checkpoint/reshard", "another optimizer",
         lambda: _load(directory, optimizer="sgd", groups=GROUPS["sgd"]), ValueError,
         "optimizer='sgd': the checkpoint holds the states of optimizer='adam'"),
        ("checkpoint/reshard", "a frozen layer trainable here", lambda: _load(directory, "mlp"),
         ValueError, "parameter 'layers.1.weight': requires_grad=True here, frozen in the "
         "checkpoint"),
        ("checkpoint/reshard", "another grouping", lambda: _load(directory, group_of=None),
         ValueError, "parameter 'layers.0.bias': parameter group 0 here, 1 in the checkpoint"),
        ("checkpoint/format", "an RNG entry missing at the same N",
         lambda: _no_rng_entry(directory), CheckpointError,
         "files['r0000.bin'] has no entry 'rng:torch_cpu'"),
    ]  # fmt: skip


def two_rank_rows(rank: int, directory: Path) -> list[Refusal]:
    """Rows on a pool of two ranks: what only a world of more than one rank can get wrong."""
    nowhere = directory / "nowhere"

    def disagree_on_units():
        model = MODELS["mlp"][0]()
        units = tuple(model.unit_names()) if rank == 0 else ()
        ZeroEngine(model, config(model, 2, units=units))

    def disagree_on_lr():
        matrices, others = GROUPS["adam"]
        lr = matrices.lr if rank == 0 else 2 * matrices.lr
        engine("mlp", 2, groups=(dataclasses.replace(matrices, lr=lr), others))

    def load_where_one_rank_has_none():
        eng = engine("mlp-frozen", 2)
        eng.load(directory / PLAIN if rank == 0 else nowhere)

    rows = [
        ("build", "a bucket smaller than the world", lambda: engine("mlp", 2, bucket_elements=1),
         ValueError, "bucket_elements=1: must be at least the world size 2"),
        ("build", "micro-batches not a multiple of N",
         lambda: engine("mlp", 2, micro_batches=3), ValueError,
         "micro_batches=3: must be a multiple of the world size 2"),
        ("build", "ranks with different unit lists", disagree_on_units, ValueError,
         "rank 1 has 1 units, rank 0 has 3"),
        ("build", "ranks with different configs", disagree_on_lr, ValueError,
         "rank 1 disagrees with rank 0 on config"),
        ("checkpoint/format", "a load that fails on rank 1 only", load_where_one_rank_has_none,
         CheckpointError, (f"load from {directory / PLAIN} failed on rank 1: CheckpointError",
                           f"{nowhere}: no such directory")),
    ]  # fmt: skip
    return [Refusal(f"{m}: {w}", m, make, e, s, world=2) for m, w, make, e, s in rows]


def rank_rows(rank: int, n: int, directory) -> list[Refusal]:
    """The rows of a pool of n ranks, as built on `rank`."""
    directory = Path(directory)
    return one_rank_rows(directory) if n == 1 else two_rank_rows(rank, directory)


def run_rows(rank: int, n: int, directory: str) -> dict[str, dict]:
    """On every rank of a pool of n: save this world's checkpoint, then every row of the
    world in order; {row name: attempt(row)}."""
    torch.set_num_threads(1)
    directory = Path(directory)
    if n == 1:
        save_plain(directory)
        (directory / "a-file").write_text("a file, not a directory")
    else:
        save_mp(directory)
    return {row.name: attempt(row) for row in rank_rows(rank, n, directory)}
