"""Helpers of tests/distributed/test_hf_checkpoint.py: tiny Hugging Face models (no download),
their engines and batches, bit comparisons, a counting wrapper of safetensors' reader, and the
damaged folders the refusals are tried on.

Module level, so that the functions the tests hand to zero.ranks' forked worker pools can use
it on every rank. Nothing here is a test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from reference import Hyper
from zero.config import ZeroConfig
from zero.engine import ZeroEngine

VOCAB, T = 64, 16
IDS = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(99))


def hf_model(kind, seed=0, **changes):
    """A random-weight model from a config (no download); the same bits in every process.
    Eager attention: from_pretrained is asked for the same (it is not saved in config.json)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        cls, cfg = GPT2LMHeadModel, GPT2Config
        kw = dict(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=T, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    else:
        cls, cfg = LlamaForCausalLM, LlamaConfig
        kw = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=T,
        )  # fmt: skip
    kw.update(bos_token_id=0, eos_token_id=0, attn_implementation="eager", **changes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(cfg(**kw))


def token_batch(step, j):
    g = torch.Generator().manual_seed(7919 * step + j)
    ids = torch.randint(0, VOCAB, (2, T), generator=g)
    return {"input_ids": ids, "labels": ids}


def engine(kind, n, stage, seed=0, freeze=(), precision="fp32"):
    model = hf_model(kind, seed)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in freeze)
    cfg = ZeroConfig(
        stage=stage, micro_batches=n, units="auto", chunk=128, optimizer="adamw",
        groups=(Hyper(lr=1e-2, weight_decay=0.1),), precision=precision,
    )  # fmt: skip
    return model, ZeroEngine(model, cfg)


def logits(module_or_engine) -> np.ndarray:
    module_or_engine.eval()
    with torch.no_grad():
        return module_or_engine(input_ids=IDS).logits.numpy()


def bits(a) -> torch.Tensor:
    """The bit patterns of a tensor or array, as integers of its width."""
    t = torch.as_tensor(a).contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


class Counting:
    """safe_open's reader, or a slice of it, with the bytes of every slice read logged."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __getattr__(self, name):  # keys(), get_shape(), get_dtype()
        return getattr(self.inner, name)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_slice(self, key):
        return Counting(self.inner.get_slice(key), self.log)

    def __getitem__(self, box):
        t = self.inner[box]
        self.log.append(t.numel() * t.element_size())
        return t


def rewrite(folder, change) -> None:
    """folder's model.safetensors with `change(tensors)` applied (a damaged folder)."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def unprefix(tensors: dict) -> None:
    """GPT-2's keys without the base model's prefix `transformer.`, as the hub's gpt2 has them."""
    for k in [k for k in tensors if k.startswith("transformer.")]:
        tensors[k.removeprefix("transformer.")] = tensors.pop(k)


def bad_folders(root: Path) -> dict[str, Path]:
    import shutil

    from transformers import GPT2Config, GPT2Model

    made = {}
    for name, model in [
        ("ok", hf_model("gpt2")),
        ("llama", hf_model("llama")),
        ("base", GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB))),
        ("shape", hf_model("gpt2", n_positions=2 * T)),
    ]:
        made[name] = root / name
        model.save_pretrained(made[name])
    changes = {
        "missing": lambda t: t.pop("transformer.ln_f.bias"),
        "f64": lambda t: t.update({"transformer.ln_f.bias": t["transformer.ln_f.bias"].double()}),
        "int": lambda t: t.update({"transformer.wpe.weight": t["transformer.wpe.weight"].int()}),
        "extra": lambda t: t.update({"transformer.h.0.attn.extra": torch.zeros(3)}),
        "unprefixed": unprefix,  # not refused: a base model's keys, as from_pretrained reads
    }
    for name, change in changes.items():
        made[name] = root / name
        shutil.copytree(made["ok"], made[name])
        rewrite(made[name], change)
    made["absent"] = root / "absent"
    made["empty"] = root / "empty"
    made["empty"].mkdir()
    (made["empty"] / "config.json").write_text((made["ok"] / "config.json").read_text())
    return made


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
