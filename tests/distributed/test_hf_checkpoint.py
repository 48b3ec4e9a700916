"""Hugging Face folders both ways (zero/checkpoint/hf.py, hfread.py; docs/checkpoints.md,
"Hugging Face folders").

1. export_hf → AutoModelForCausalLM.from_pretrained → the same logits as the engine's model on a
   batch, bit for bit (fp32), and every tensor in the folder the gathered fp32 master's bits. The
   covering subset (one step of AdamW before each export, so the weights are trained ones):
       GPT-2 (tied lm_head):  N = 1 stage 0 (one file), N = 2 stage 3 (shards + index; also a
                              bf16 export), N = 4 stage 1 (shards)
       Llama (GQA, untied):   N = 2 stage 2 (one file), N = 4 stage 3 (shards + index)
   so every stage, every N of 1, 2, 4 and both models are covered, each with one file and with
   shards, and frozen parameters (a GPT-2 with its position embedding frozen) at N = 2 stage 3.
2. save_pretrained of a tiny model (GPT-2 in one file, Llama in shards) → init_from_hf at
   N = 2, stage 3 → the gathered master equals the folder's tensors bit for bit, the engine's
   logits equal the folder's model's, and each rank read exactly the bytes of its own shards
   (counted by wrapping safetensors' get_slice); under bf16 at N = 2 stage 1, the fp32 master
   is the folder's bits and the working copy their rounding; a model built on the meta device
   (hf.meta_model, N = 2 stage 3) starts from the folder's values.
3. Refusals, each one line naming the file or key, the value and what is allowed (at N = 1); a
   failed export leaves the folder that was there as it was, and no temporary folder (N = 1, and
   at N = 2 a failure on rank 0 makes both ranks raise).
The models, engines and helpers: tests/helpers/hf_tools.py.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.engine_tools import patched
from tests.helpers.hf_tools import (
    Counting,
    bad_folders,
    bits,
    engine,
    folder_tensors,
    hf_model,
    logits,
    snapshot,
    token_batch,
)
from zero.checkpoint import hf, hfread
from zero.checkpoint.commit import _buffers
from zero.checkpoint.hf import export_hf, init_from_hf
from zero.config import ZeroConfig
from zero.engine import ZeroEngine
from zero.loop import train_steps
from zero.ranks.local import get_pool

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[models]')",
)
# -- 1. export → from_pretrained --------------------------------------------------------------

EXPORTS = [  # (model, N, stage, max_shard_bytes, frozen)
    ("gpt2", 1, 0, hf.DEFAULT_MAX_SHARD_BYTES, ()),
    ("gpt2", 2, 3, 20_000, ("transformer.wpe.weight",)),
    ("gpt2", 4, 1, 30_000, ()),
    ("llama", 2, 2, hf.DEFAULT_MAX_SHARD_BYTES, ()),
    ("llama", 4, 3, 20_000, ()),
]


def export_cell(rank, n, kind, stage, folder, max_shard, freeze):
    from transformers import AutoModelForCausalLM

    model, eng = engine(kind, n, stage, freeze=freeze)
    train_steps(eng, token_batch, 1)
    got = export_hf(eng, model, folder, max_shard_bytes=max_shard)
    if kind == "gpt2" and stage == 3:
        export_hf(eng, model, f"{folder}-bf16", dtype=torch.bfloat16)
    master, _ = eng.gather_state()
    with eng.gathered_params():
        held = {k: p.detach().clone() for k, p in model.named_parameters()}
    mine = logits(eng)  # every rank: at stage 3 the forward gathers
    if rank != 0:
        return None
    loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    tied = kind == "gpt2" and loaded.lm_head.weight is loaded.transformer.wte.weight
    return {
        "returned": str(got),
        "mine": mine,
        "theirs": logits(loaded),
        "master": {k: v.numpy() for k, v in master.items()},
        "held": {k: v.numpy() for k, v in held.items()},
        "tied": tied,
        "class": type(loaded).__name__,
    }


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for kind, n, stage, shard, freeze in EXPORTS:
        folder = root / f"{kind}-n{n}-s{stage}"
        out[(kind, n, stage)] = (
            folder,
            get_pool(n).run(export_cell, kind, stage, str(folder), shard, freeze, timeout_s=300),
        )
    return out


@pytest.mark.dist
@pytest.mark.parametrize("kind,n,stage", [c[:3] for c in EXPORTS])
def test_exported_folder_gives_the_engines_logits_bit_for_bit(exports, kind, n, stage):
    folder, per_rank = exports[(kind, n, stage)]
    r0 = per_rank[0]
    assert r0["returned"] == str(folder) and all(r is None for r in per_rank[1:])
    assert r0["class"] == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]
    assert torch.equal(bits(r0["mine"]), bits(r0["theirs"]))
    # not vacuous: the step moved the weights, so the logits differ from the untrained model's
    assert not torch.equal(bits(r0["mine"]), bits(logits(hf_model(kind))))
    if kind == "gpt2":
        assert r0["tied"]  # from_pretrained tied lm_head to wte again


@pytest.mark.dist
@pytest.mark.parametrize("kind,n,stage,shard,freeze", EXPORTS)
def test_exported_tensors_are_the_master_bit_for_bit(exports, kind, n, stage, shard, freeze):
    """Every key once (GPT-2's lm_head.weight not written: Hugging Face ties it on load), each
    the gathered fp32 master's bits (a frozen one: the held values); files as max_shard_bytes
    cuts them, the index naming each key's file."""
    import json

    folder, per_rank = exports[(kind, n, stage)]
    r0, saved = per_rank[0], folder_tensors(folder)
    expected = set(r0["held"])  # named_parameters: GPT-2's tied lm_head.weight is wte's
    assert kind != "gpt2" or "lm_head.weight" not in expected
    assert set(saved) == expected
    for k, v in saved.items():
        want = r0["held"][k] if k in freeze else r0["master"][k]
        assert v.dtype == torch.float32 and torch.equal(bits(v), bits(want)), k
    files = sorted(p.name for p in folder.iterdir())
    if shard == hf.DEFAULT_MAX_SHARD_BYTES:
        assert files == ["config.json", "generation_config.json", "model.safetensors"]
        return
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in files
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == expected and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in saved.values())
    for f in shards:  # each file at most max_shard_bytes of data, unless one tensor is larger
        sizes = [saved[k].numel() * 4 for k, v in index["weight_map"].items() if v == f]
        assert sum(sizes) <= shard or len(sizes) == 1
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp left


@pytest.mark.dist
def test_bf16_export_is_the_master_rounded_to_nearest_even(exports):
    folder, per_rank = exports[("gpt2", 2, 3)]
    saved, master = folder_tensors(f"{folder}-bf16"), per_rank[0]["master"]
    held = per_rank[0]["held"]
    assert set(saved) == set(folder_tensors(folder))
    for k, v in saved.items():
        want = torch.from_numpy(held[k] if k == "transformer.wpe.weight" else master[k])
        assert v.dtype == torch.bfloat16 and torch.equal(bits(v), bits(want.bfloat16())), k
    cfg = (Path(f"{folder}-bf16") / "config.json").read_text()
    assert '"dtype": "bfloat16"' in cfg


# -- 2. save_pretrained → init_from_hf at N = 2, stage 3 --------------------------------------


def import_cell(rank, n, kind, folder):
    from transformers import AutoModelForCausalLM

    model, eng = engine(kind, n, 3, seed=1)  # other start values than the folder's
    log: list[int] = []
    real = hfread._open
    with patched(hfread, _open=lambda path: Counting(real(path), log)):
        info = init_from_hf(eng, folder)
    master, _ = eng.gather_state()
    mine = logits(eng)
    units = [u.part for u in eng.units]
    out = {
        "read": sum(log),
        "reported": info.bytes_read,
        "real": sum(p.real_elements(rank) for p in units),
        "shard": sum(p.shard_numel for p in units),
        "buffers": [k for k, _ in _buffers(model)],
        "tied": kind != "gpt2" or model.lm_head.weight is model.transformer.wte.weight,
    }
    if rank == 0:
        theirs = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        out.update(
            mine=mine, theirs=logits(theirs), master={k: v.numpy() for k, v in master.items()}
        )
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def imported(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(f"pretrained-{kind}")
    # GPT-2 in one file; Llama cut by save_pretrained into shards and an index
    hf_model(kind).save_pretrained(folder, max_shard_size="40KB" if kind == "llama" else "5GB")
    return kind, folder, get_pool(2).run(import_cell, kind, str(folder), timeout_s=300)


@pytest.mark.dist
def test_init_from_hf_gives_the_folders_values_bit_for_bit(imported):
    kind, folder, per_rank = imported
    saved, r0 = folder_tensors(folder), per_rank[0]
    if kind == "llama":
        assert (folder / "model.safetensors.index.json").exists()
    assert set(saved) == set(r0["master"])  # GPT-2's tied lm_head: under wte's name in both
    for k, v in r0["master"].items():
        assert torch.equal(bits(v), bits(saved[k])), k
    assert all(r["tied"] for r in per_rank)
    assert torch.equal(bits(r0["mine"]), bits(r0["theirs"]))
    # not vacuous: the engine was built from other start values (seed 1)
    assert not torch.equal(bits(r0["mine"]), bits(logits(hf_model(kind, seed=1))))


@pytest.mark.dist
def test_each_rank_reads_only_its_own_shards(imported):
    """Bytes read per rank, counted at safetensors' get_slice. Derivation: at stage 3 a rank
    holds, of each unit u, only its own shard [r·L_u, (r+1)·L_u) of the master and of the
    working copy (persist_below = 0: no unit stays whole), and the model has no persistent
    buffer; every tensor in the folder is F32 (4 bytes); init_from_hf reads the flat range of
    each parameter slot that meets the shard as boxes that hold exactly its elements. So rank r
    reads exactly 4·Σ_u real_u(r) bytes (real_u(r): the shard's non-padding elements), which is
    at most its shard's 4·Σ_u L_u, and the ranks together read each parameter once: 4·Ψ."""
    kind, folder, per_rank = imported
    psi = sum(v.numel() for v in folder_tensors(folder).values())
    for r in per_rank:
        assert r["buffers"] == []
        assert r["read"] == r["reported"] == 4 * r["real"] <= 4 * r["shard"]
        assert r["read"] < 4 * psi  # not the whole model
    assert sum(r["read"] for r in per_rank) == 4 * psi


def meta_import_cell(rank, n, folder):
    """The folder's model built with its parameters on the meta device (hf.meta_model), each
    unit materialised alone as zeros, then filled by init_from_hf."""
    model = hf.meta_model(folder, attn_implementation="eager")
    on_meta = all(p.is_meta for p in model.parameters())
    cfg = ZeroConfig(stage=3, micro_batches=n, units="auto", chunk=128)
    eng = ZeroEngine(model, cfg, device="cpu", init_seed=None)  # each unit zeros
    init_from_hf(eng, folder)
    master, _ = eng.gather_state()
    rules = {r for unit in eng.init_report.values() for r in unit.values()}
    return on_meta, rules, {k: v.numpy() for k, v in master.items()}, logits(eng)


@pytest.mark.dist
def test_a_meta_device_model_starts_from_the_folder(imported):
    kind, folder, per_rank = imported
    saved = folder_tensors(folder)
    on_meta, rules, master, mine = get_pool(2).run(meta_import_cell, str(folder))[0]
    assert on_meta and rules == {"zeros"}
    assert set(master) == set(saved)
    for k, v in saved.items():
        assert torch.equal(bits(master[k]), bits(v)), k
    assert torch.equal(bits(mine), bits(per_rank[0]["theirs"]))


def bf16_import_cell(rank, n, folder):
    """init_from_hf under bf16 at stage 1: the fp32 master apart from the working copy."""
    model, eng = engine("llama", n, 1, seed=1, precision="bf16")
    init_from_hf(eng, folder)
    master, _ = eng.gather_state()
    held = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {k: v.numpy() for k, v in master.items()}, held


@pytest.mark.dist
def test_init_from_hf_under_bf16_fills_the_fp32_master_and_the_rounded_working_copy(tmp_path):
    folder = tmp_path / "llama"
    hf_model("llama").save_pretrained(folder, max_shard_size="40KB")
    saved = folder_tensors(folder)
    for master, held in get_pool(2).run(bf16_import_cell, str(folder), timeout_s=120):
        assert set(master) == set(held) == set(saved)
        for k, v in saved.items():
            assert torch.equal(bits(master[k]), bits(v)), k  # fp32, exact
            assert torch.equal(bits(held[k]), bits(v.bfloat16())), k  # bf16, rounded


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (), (0, 3)])
def test_boxes_read_exactly_a_flat_range(shape):
    """hfread._boxes over every range [a, b): the boxes' elements in order are the flat range,
    at most 2·ndim - 1 boxes."""
    numel = math.prod(shape)
    x = torch.arange(numel).reshape(shape)
    for a in range(numel + 1):
        for b in range(a, numel + 1):
            boxes = hfread._boxes(shape, a, b)
            got = [x[box].reshape(-1) for box in boxes]
            got = torch.cat(got) if got else torch.empty(0, dtype=x.dtype)
            assert torch.equal(got, torch.arange(a, b)), (shape, a, b)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


# -- 3. refusals --------------------------------------------------------------------------------


def refusal_cell(rank, n, folders, root):
    """Every refusal at N = 1, stage 0: {case: the error's type and message}."""
    import errno

    root, said = Path(root), {}

    def attempt(case, fn, *args, **kw):
        try:
            fn(*args, **kw)
        except Exception as exc:
            said[case] = (type(exc).__name__, str(exc))
        else:
            said[case] = ("no error", "")

    model, eng = engine("gpt2", n, 0)
    for case, folder in folders.items():
        if case not in ("ok", "unprefixed"):
            attempt(case, init_from_hf, eng, folder)
    init_from_hf(eng, folders["unprefixed"])  # the base model's keys are taken
    unprefixed = {k: v.numpy() for k, v in eng.gather_state()[0].items()}
    attempt("other model", export_hf, eng, hf_model("gpt2"), root / "x")
    attempt("shard bytes", export_hf, eng, model, root / "x", max_shard_bytes=0)
    attempt("dtype", export_hf, eng, model, root / "x", dtype=torch.float64)
    (root / "notes").mkdir()
    (root / "notes" / "notes.txt").write_text("mine")
    attempt("not an export", export_hf, eng, model, root / "notes")
    export_hf(eng, model, root / "prev", max_shard_bytes=20_000)
    before = snapshot(root / "prev")
    train_steps(eng, token_batch, 1)
    attempt("stepped", init_from_hf, eng, folders["ok"])
    writes, seen = [], []

    def full_disk(f, chunk):
        writes.append(1)
        if len(writes) == 12:  # file 2 of 7 is being written: the temporary folder holds
            seen.extend(sorted(p.name for p in next(root.glob(".prev.*.tmp")).iterdir()))
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(chunk)

    with patched(hf, _write_all=full_disk):
        attempt("full disk", export_hf, eng, model, root / "prev", max_shard_bytes=20_000)
    kept = snapshot(root / "prev") == before
    with patched(hf, _exchange=lambda a, b: False):  # the two renames, where no swap exists
        export_hf(eng, model, root / "prev")  # now replaced: one file, the trained values
    left = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    replaced = sorted(snapshot(root / "prev"))
    return said, dict(kept=kept, left=left, replaced=replaced, seen=seen, unprefixed=unprefixed)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    folders = bad_folders(tmp_path_factory.mktemp("folders"))
    root = tmp_path_factory.mktemp("targets")
    said, after = get_pool(1).run(
        refusal_cell, {k: str(v) for k, v in folders.items()}, str(root), timeout_s=300
    )[0]
    return folders, root, said, after


IMPORT_REFUSALS = {  # case: what its one line must name (besides the folder, and "allowed")
    "llama": ["config.json: model_type 'llama'", "'gpt2' (GPT2LMHeadModel)"],
    "base": ["config.json: architectures ['GPT2Model']", "GPT2LMHeadModel"],
    "shape": ["safetensors: 'transformer.wpe.weight' has shape (32, 32)", "has (16, 32)"],
    "missing": ["parameter 'transformer.ln_f.bias' (shape (32,)) is missing", "'ln_f.bias'"],
    "f64": ["model.safetensors: 'transformer.ln_f.bias' is F64", "'F32'"],
    "int": ["model.safetensors: 'transformer.wpe.weight' is I32", "'BF16'"],
    "extra": ["'transformer.h.0.attn.extra' is no parameter or buffer of"],
    "absent": ["absent: no such folder"],
    "empty": ["empty: holds neither model.safetensors nor"],
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(IMPORT_REFUSALS))
def test_init_from_hf_refuses_by_name(refusals, case):
    folders, _, said, _ = refusals
    kind, message = said[case]
    assert kind == "ValueError" and "\n" not in message, (case, kind, message)
    assert str(folders[case]) in message and "allowed" in message, message
    for part in IMPORT_REFUSALS[case]:
        assert part in message, (part, message)


@pytest.mark.dist
def test_export_refusals_name_the_value_and_leave_folders_alone(refusals):
    folders, root, said, _ = refusals
    assert said["other model"] == (
        "ValueError",
        "model=GPT2LMHeadModel: not the module this engine wraps (GPT2LMHeadModel); pass "
        "engine.module",
    )
    assert said["shard bytes"] == ("ValueError", "max_shard_bytes=0: allowed is an integer >= 1")
    assert said["dtype"][1].startswith("dtype=torch.float64: allowed are [torch.float32, ")
    kind, message = said["not an export"]
    assert kind == "ValueError" and "\n" not in message
    assert f"folder={str(root / 'notes')!r}: holds ['notes.txt']" in message
    assert (root / "notes" / "notes.txt").read_text() == "mine"  # untouched
    assert not (root / "x").exists()
    kind, message = said["stepped"]
    assert kind == "ValueError" and "t=1 optimizer steps" in message and "allowed" in message


@pytest.mark.dist
def test_a_failed_export_leaves_the_previous_folder_as_it_was(refusals):
    _, root, said, after = refusals
    assert said["full disk"][0] == "OSError" and "No space left" in said["full disk"][1]
    shards = [f"model-0000{k}-of-00007.safetensors" for k in (1, 2)]
    assert after["seen"] == shards  # it failed midway: one file whole, the next begun
    assert after["kept"]  # every file of the previous export, byte for byte
    assert after["left"] == []  # no temporary folder, no old folder set aside
    assert after["replaced"] == ["config.json", "generation_config.json", "model.safetensors"]


def failing_rank_cell(rank, n, folder):
    """Rank 0's disk fills mid-export at stage 3: every rank raises, none waits for ever."""
    import errno

    model, eng = engine("gpt2", n, 3)
    writes = []

    def full_disk(f, chunk):
        writes.append(1)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(chunk)

    said = ("no error", "")
    try:
        with patched(hf, _write_all=full_disk if rank == 0 else hf._write_all):
            export_hf(eng, model, folder)
    except Exception as exc:
        said = (type(exc).__name__, str(exc))
    return said, train_steps(eng, token_batch, 1)[0].loss  # the ranks still pair up


@pytest.mark.dist
def test_a_rank_that_fails_an_export_makes_every_rank_raise(tmp_path):
    per_rank = get_pool(2).run(failing_rank_cell, str(tmp_path / "hf"), timeout_s=120)
    assert per_rank[0][0][0] == "OSError"
    kind, message = per_rank[1][0]
    assert kind == "CheckpointError" and "failed on rank 0: OSError" in message
    assert per_rank[0][1] == per_rank[1][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no temporary one


@pytest.mark.dist
def test_the_memory_measurement_runs_on_a_small_llama(tmp_path):
    """measure/parts/hf_memory.py's ranks on a small shape: each rank's record, the bytes it read
    those of its shards, both ranks together the folder's values once."""
    from measure.parts import hf_memory

    args = hf_memory.parser().parse_args(
        ["--layers", "2", "--width", "64", "--mlp", "128", "--heads", "4", "--kv-heads", "2"]
        + ["--vocab", "256", "--dir", str(tmp_path)]
    )
    hf_memory.check(args)
    per_rank = get_pool(2).run(hf_memory.rank_main, args, timeout_s=120)
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert per_rank[0]["files"] == 3  # config, generation config, one safetensors file
    assert sum(r["init"]["bytes_read"] for r in per_rank) == 4 * per_rank[0]["params"]
    for r in per_rank:
        assert r["init"]["bytes_read"] <= r["rank_model_bytes"]
        assert set(r["export"]) == {"seconds", "anon_growth", "file_growth", "anon_before"}


@pytest.mark.dist
def test_keys_without_the_base_models_prefix_are_taken(refusals):
    folders, _, _, after = refusals
    saved = folder_tensors(folders["unprefixed"])
    assert "wte.weight" in saved and "transformer.wte.weight" not in saved
    assert set(after["unprefixed"]) == {f"transformer.{k}" for k in saved}
    for k, v in saved.items():
        assert torch.equal(bits(after["unprefixed"][f"transformer.{k}"]), bits(v)), k
