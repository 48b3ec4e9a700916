"""The refusals section's Hugging Face rows (zero/checkpoint/hf.py, hfread.py), on a pool of one
rank: export_hf's arguments and target folders, init_from_hf's engines and folders. Each row
builds what it needs under the section's directory; the models are random-weight GPT-2s and a
Llama of a few thousand parameters (no download). Rows where transformers is missing are not
built (the section then has none of them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from zero.config import ZeroConfig
from zero.engine import ZeroEngine

from .rows import Refusal

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def _gpt2(n_layer: int = 2, n_embd: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=32, n_positions=8)
    return GPT2LMHeadModel(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=32)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _engine(model=None) -> ZeroEngine:
    model = _gpt2() if model is None else model
    return ZeroEngine(model, ZeroConfig(stage=1, chunk=128, units="auto"))


def _call(what: str, eng, folder, **kw):
    from zero.checkpoint import export_hf, init_from_hf

    if what == "export":
        return export_hf(eng, kw.pop("model", eng.module), folder, **kw)
    return init_from_hf(eng, folder)


def _exported(directory: Path, name: str = "gpt2") -> Path:
    """A folder export_hf wrote from a fresh two-layer GPT-2 (once per directory)."""
    folder = directory / f"hf-{name}"
    if not folder.exists():
        _call("export", _engine(), folder)
    return folder


def _prepared(directory: Path) -> dict[str, Path]:
    """The targets and folders the rows read, made before the rows run."""
    d = directory / "hf-rows"
    d.mkdir(exist_ok=True)
    (d / "a-file").write_text("not a folder")
    (d / "others").mkdir(exist_ok=True)
    (d / "others" / "notes.txt").write_text("mine")
    if not (d / "link").is_symlink():
        (d / "link").symlink_to(d / "others")
    (d / "config-only").mkdir(exist_ok=True)
    cfg = json.loads((_exported(directory) / "config.json").read_text())
    (d / "config-only" / "config.json").write_text(json.dumps(cfg))
    for name, index in (("bad-index", {"weight_map": {"wte": "../x"}}), ("not-json", None)):
        (d / name).mkdir(exist_ok=True)
        (d / name / "config.json").write_text(json.dumps(cfg))
        (d / name / INDEX).write_text("{" if index is None else json.dumps(index))
    return {p.name: p for p in d.iterdir()}


def _stepped_import(folder: Path):
    eng = _engine()
    eng.inject_gradients({k: torch.zeros_like(p) for k, p in eng.module.named_parameters()})
    eng.step()
    return _call("import", eng, folder)


def hf_rows(directory: Path) -> list[Refusal]:
    """The rows; each `make` prepares what it reads (lazily: the rows are also built, to be
    counted, where no process group exists)."""
    if importlib.util.find_spec("transformers") is None:
        return []

    def at(name: str) -> Path:
        return _prepared(directory)[name]

    def ok() -> Path:
        return _exported(directory)

    def export(target, **kw):
        return lambda: _call("export", _engine(), target(), **kw)

    def load(folder, model=None):
        return lambda: _call("import", _engine(None if model is None else model()), folder())

    mlp = lambda: torch.nn.Sequential(torch.nn.Linear(4, 4))  # noqa: E731
    allowed = "allowed is a folder save_pretrained or export_hf wrote"
    others = lambda: at("others")  # noqa: E731
    rows = [
        ("export: a model not the engine's", export(others, model=_gpt2()),
         "model=GPT2LMHeadModel: not the module this engine wraps (GPT2LMHeadModel)"),
        ("export: a model without a Hugging Face config",
         lambda: (lambda m: _call("export", _engine(m), others(), model=m))(mlp()),
         "model=Sequential: has no Hugging Face config (model.config)"),
        ("export: files of no bytes", export(others, max_shard_bytes=0),
         "max_shard_bytes=0: allowed is an integer >= 1"),
        ("export: a size as text", export(others, max_shard_bytes="1"),
         "max_shard_bytes='1': allowed is an integer >= 1"),
        ("export: float64", export(others, dtype=torch.float64),
         "dtype=torch.float64: allowed are"),
        ("export: into a symbolic link", export(lambda: at("link")), "link': a symbolic link"),
        ("export: into no parent folder", export(lambda: at("a-file") / "x"),
         "is not a folder; allowed"),
        ("export: onto a file", export(lambda: at("a-file")), "exists and is not a folder"),
        ("export: over a user's files", export(others),
         "holds ['notes.txt'], which an export does not write"),
        ("import: no folder", load(lambda: others() / "absent"),
         "absent: no such folder; allowed is a folder of a Hugging Face model"),
        ("import: into a stepped engine", lambda: _stepped_import(ok()),
         "init_from_hf: the engine has taken t=1 optimizer steps"),
        ("import: a module without a config", load(ok, mlp),
         "init_from_hf: the engine's module (Sequential) has no Hugging Face config"),
        ("import: another architecture", load(ok, _llama),
         "model_type 'gpt2', the engine's model is 'llama' (LlamaForCausalLM)"),
        ("import: a folder without weights", load(lambda: at("config-only")),
         f"holds neither {SINGLE} nor {INDEX}; {allowed}"),
        ("import: an index naming paths", load(lambda: at("bad-index")),
         "weight_map must map keys to file names in the folder"),
        ("import: an index not JSON", load(lambda: at("not-json")), "does not read as JSON"),
        ("import: a parameter missing", load(ok, lambda: _gpt2(n_layer=3)),
         "parameter 'transformer.h.2.ln_1.weight' (shape (16,)) is missing"),
        ("import: another width", load(ok, lambda: _gpt2(n_embd=32)),
         "has shape (32, 16), the model's 'transformer.wte.weight' has (32, 32)"),
    ]  # fmt: skip
    module = {"export": "checkpoint/hf", "import": "checkpoint/hfread"}
    return [
        Refusal(f"{module[w.split(':')[0]]}: {w}", module[w.split(":")[0]], make, ValueError, says,
                world=1)
        for w, make, says in rows
    ]  # fmt: skip
