"""``python -m paper_figures.hf_curve``: a Hugging Face GPT-2 trained by the engine and by plain
PyTorch, loss against step, on the project's corpus (docs/models.md, "Parity over a run").

The model: a small ``GPT2LMHeadModel`` from a ``GPT2Config`` with random weights (no download;
byte vocabulary, dropout off, eager attention, lm_head tied to wte). Both sides start from the
same bits and see the same data (micro-batch j of step s is ``Corpus.batch(split="train", seed,
index=(s, j))``, zero/workloads/data.py): the engine at stage 3 on N = 2 local ranks (deterministic
mode, micro-batch j on rank j mod N), and one process running (loss_j / M).backward() for every j,
clip_grad_norm_ and torch.optim.AdamW(foreach=False) with the same two groups. Unlike the
lock-step cells of `python -m verify --parity`, nothing is resynchronised: rounding differences
compound over the steps, and the curve shows how far. Writes a zero.common.results record
(``--json``) and the figure (``--figure``); prints the max |Δloss| and the final losses.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import time
from pathlib import Path

import torch

from reference import Hyper
from zero.common.results import make_record, write_atomic, write_json
from zero.config import ZeroConfig, decay_matrices_only
from zero.engine import ZeroEngine
from zero.loop import train_steps
from zero.optim import plain as zero_plain
from zero.ranks.local import spawn
from zero.workloads.data import VOCAB_SIZE, load_corpus

KIND = "hf_curve.run"
DEFAULT_OUT = Path("runs/hf_curve")
GROUPS = (Hyper(lr=1e-3, weight_decay=0.1), Hyper(lr=1e-3))  # matrices decayed; biases, norms not


def gpt2(seed: int, n_layer: int, n_embd: int, seq_len: int):
    """The random-weight GPT-2; the same bits in every process for one seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 32), vocab_size=VOCAB_SIZE,
        n_positions=seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg)


def batch_fn(corpus, args):
    def microbatch(step: int, j: int) -> dict:
        ids, _ = corpus.batch(
            split="train", seed=args.seed, index=(step, j), batch_size=args.batch_size,
            seq_len=args.seq_len,
        )  # fmt: skip
        return {"input_ids": ids, "labels": ids}  # GPT-2 shifts the labels itself

    return microbatch


def engine_rank(rank: int, n: int, args, corpus) -> list[float]:
    model = gpt2(args.seed, args.n_layer, args.n_embd, args.seq_len)
    cfg = ZeroConfig(
        stage=args.stage, micro_batches=args.micro_batches, units="auto", optimizer="adamw",
        groups=GROUPS, group_of=decay_matrices_only, clip_norm=args.clip_norm, chunk=128,
    )  # fmt: skip
    eng = ZeroEngine(model, cfg)
    results = train_steps(eng, batch_fn(corpus, args), args.steps)
    return [r.loss for r in results]


def plain_losses(args, corpus) -> list[float]:
    """The textbook single-process loop on the same global batch."""
    torch.set_num_threads(1)  # as the ranks run
    model = gpt2(args.seed, args.n_layer, args.n_embd, args.seq_len)
    members: list[list] = [[], []]
    for name, p in model.named_parameters():
        members[decay_matrices_only(name, p)].append(p)
    opt = zero_plain.torch_optimizer("adamw", list(zip(members, GROUPS)), foreach=False)
    microbatch, m, out = batch_fn(corpus, args), args.micro_batches, []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        losses = []
        for j in range(m):
            loss = model(**microbatch(step, j)).loss
            (loss / m).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        opt.step()
        out.append(math.fsum(losses) / m)
    return out


def plot(steps, engine, plain, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(steps, plain, lw=1.6, label="plain PyTorch (one process, AdamW)")
    ax.plot(steps, engine, lw=0.8, ls="--", label="ZeroEngine (stage 3, N = 2)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (cross-entropy, nats per byte)")
    ax.set_title(title)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    write_atomic(path, buf.getvalue())


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m paper_figures.hf_curve", description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4, help="M, a multiple of --nproc")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=DEFAULT_OUT / "hf_curve.json")
    p.add_argument("--figure", type=Path, default=DEFAULT_OUT / "hf_curve.png")
    args = p.parse_args(argv)
    if args.steps < 1 or args.nproc < 1 or args.micro_batches % args.nproc:
        p.error(
            f"--steps {args.steps} --nproc {args.nproc} --micro-batches {args.micro_batches}: "
            "steps and nproc must be >= 1 and micro-batches a multiple of nproc"
        )
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("transformers is not installed (pip install -e '.[models]')")
    corpus = load_corpus()
    t0 = time.time()
    engine = spawn(engine_rank, args.nproc, args, corpus, timeout_s=7200)[0]
    t1 = time.time()
    plain = plain_losses(args, corpus)
    t2 = time.time()
    diffs = [abs(a - b) for a, b in zip(engine, plain, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    # the corpus by content and counts (its location is this machine's, not the record's)
    fingerprint = {k: v for k, v in corpus.fingerprint.items() if k != "location"}
    config.update(groups=[vars(h) for h in GROUPS], corpus=fingerprint)
    result = {
        "engine_losses": engine,
        "plain_losses": plain,
        "max_abs_diff": diffs[worst],
        "max_abs_diff_step": worst,
        "final_engine": engine[-1],
        "final_plain": plain[-1],
        "engine_s": round(t1 - t0, 1),
        "plain_s": round(t2 - t1, 1),
    }
    record = make_record(config=config, result=result, kind=KIND)
    write_json(args.json, record)
    title = f"Hugging Face GPT-2 ({args.n_layer} layers, d={args.n_embd}), {args.steps} steps"
    plot(list(range(args.steps)), engine, plain, args.figure, title)
    print(
        f"max |Δloss| {diffs[worst]:.3g} at step {worst}; final loss engine {engine[-1]:.6f}, "
        f"plain {plain[-1]:.6f} (first {plain[0]:.4f}); wrote {args.json}, {args.figure}"
    )
    return record


if __name__ == "__main__":
    main()
