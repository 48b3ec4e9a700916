"""python -m zero.workloads.train as users run it: the loss falls, every stage gives the same bits,
a resumed run is the uninterrupted one, the corpus split depends on names only, torchrun works, and
bad input is refused by name."""

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun import torchrun

from zero.workloads.data import load_corpus, split_names, stdlib_dir, stdlib_files
from zero.workloads.models import GPT
from zero.workloads.train import MODELS, main, parse

REPO = Path(__file__).resolve().parents[2]
# tiny model, no checkpoints or evaluations in between unless a test asks: seconds per run
FAST = ["--model", "tiny", "--eval-every", "0", "--ckpt-every", "0", "--log-every", "100"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """A small text file (this project's own sources, ~0.3 MB): quicker to load than the stdlib."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    sources = sorted((REPO / "zero").glob("*.py")) + sorted((REPO / "reference").glob("*.py"))
    path.write_bytes(b"\n".join(p.read_bytes() for p in sources))
    return path


def run(tmp: Path, *args: str) -> dict:
    return main([*FAST, "--out", str(tmp), *args])


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_loss_decreases_on_a_tiny_run(tmp_path):
    """On the default corpus (the stdlib), 40 steps of the tiny GPT take the validation loss from
    ln 256 (near-uniform logits at init) at least halfway down to the byte-unigram entropy H1 of
    the training text, the loss of a model that learned byte frequencies and nothing else."""
    log = main(["--model", "tiny", "--steps", "40", "--eval-every", "20", "--out", str(tmp_path)])
    corpus = load_corpus()
    counts = torch.bincount(corpus.train.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    h1 = float(-(p * p.log()).sum())
    val = log["result"]["history"]["val"]
    assert [v["step"] for v in val] == [0, 20, 40]
    assert abs(val[0]["loss"] - math.log(256)) < 0.05 * math.log(256), val  # init: ~uniform
    assert val[-1]["loss"] < (math.log(256) + h1) / 2, (val, h1)
    train = [h["loss"] for h in log["result"]["history"]["train"]]
    assert sum(train[-5:]) / 5 < (math.log(256) + h1) / 2, train
    # the log and the curve are on disk, the corpus recorded
    on_disk = json.loads((tmp_path / "train_log.json").read_text())
    assert on_disk["result"]["final_master_sha256"] == log["result"]["final_master_sha256"]
    fp = on_disk["config"]["corpus"]
    assert fp["source"] == "stdlib" and fp["python"] == platform.python_version()
    assert fp["files"] == len(stdlib_files()) and fp["bytes"] == fp["train_bytes"] + fp["val_bytes"]
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_stages_0_to_3_give_the_same_bits(tmp_path, text):
    """Deterministic mode: the final fp32 master is the same bits at every stage (N = 2, M = 4:
    two micro-steps of accumulation) and at N = 1; the hash does change with training."""
    common = ["--data", str(text), "--steps", "3", "--micro-batches", "4"]
    hashes = {
        f"stage {s}": run(tmp_path / f"s{s}", *common, "--stage", str(s), "--nproc", "2")
        for s in range(4)
    }
    hashes["N = 1"] = run(tmp_path / "n1", *common, "--stage", "0", "--nproc", "1")
    hashes = {k: v["result"]["final_master_sha256"] for k, v in hashes.items()}
    assert len(set(hashes.values())) == 1, hashes
    fewer = run(tmp_path / "two", "--data", str(text), "--steps", "2", "--micro-batches", "4")
    assert fewer["result"]["final_master_sha256"] != hashes["stage 0"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resume_equals_an_uninterrupted_run(tmp_path, text):
    """2 steps at stage 1, then --resume at stage 3 up to 4 steps == 4 steps at stage 2 in one
    go: the same final bits and the same losses at every step; the log carries over."""
    data = ["--data", str(text), "--nproc", "2"]
    run(tmp_path / "a", *data, "--stage", "1", "--steps", "2")
    resumed = run(tmp_path / "a", *data, "--stage", "3", "--steps", "4", "--resume")
    whole = run(tmp_path / "b", *data, "--stage", "2", "--steps", "4", "--resume-if-present")
    r, w = resumed["result"], whole["result"]
    assert r["final_master_sha256"] == w["final_master_sha256"]
    assert [h["step"] for h in r["history"]["train"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in r["history"]["train"]] == [h["loss"] for h in w["history"]["train"]]
    assert r["data_step"] == 4 and (tmp_path / "a" / "ckpt" / "latest").is_file()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_torchrun_runs_the_same_training(tmp_path, text):
    """torchrun --standalone on CPU: gloo, the launched world, rank 0 alone reports, and the
    same bits as the locally spawned run of the same configuration."""
    args = [*FAST, "--data", str(text), "--steps", "2", "--stage", "3"]
    done = torchrun("zero.workloads.train", [*args, "--out", str(tmp_path / "t")], timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("GPT tiny") == 1, done.stdout  # one header: rank 0's
    log = json.loads((tmp_path / "t" / "train_log.json").read_text())
    c = log["config"]
    assert (c["launcher"], c["backend"], c["world_size"]) == ("torchrun", "gloo", 2)
    local = main([*args, "--nproc", "2", "--out", str(tmp_path / "s")])
    assert local["config"]["launcher"] == "spawn"
    assert log["result"]["final_master_sha256"] == local["result"]["final_master_sha256"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_model_parallel_training_is_the_same_bits_at_every_dp_degree_and_resumes(tmp_path, text):
    """--mp 2 (zero/mp/): 3 steps at N_d = 1 (stage 0) and at N_d = 2 (stage 3) end in the same
    joined master and the same losses (the bits at fixed N_m do not depend on N_d or the stage,
    docs/design.md §6); 2 steps at N_d = 2, stage 1, resumed at N_d = 1, stage 2 up to 3 steps,
    end there too (checkpoints at (N_d, N_m)). The log records the mesh and the whole GPT's
    parameter count."""
    common = ["--data", str(text), "--mp", "2", "--micro-batches", "2"]
    one = run(tmp_path / "one", *common, "--nproc", "2", "--stage", "0", "--steps", "3")
    two = run(tmp_path / "two", *common, "--nproc", "4", "--stage", "3", "--steps", "3")
    run(tmp_path / "r", *common, "--nproc", "4", "--stage", "1", "--steps", "2")
    back = run(tmp_path / "r", *common, "--nproc", "2", "--stage", "2", "--steps", "3", "--resume")
    losses = [[h["loss"] for h in r["result"]["history"]["train"]] for r in (one, two, back)]
    assert losses[0] == losses[1] == losses[2], losses
    assert len({r["result"]["final_master_sha256"] for r in (one, two, back)}) == 1
    assert one["config"]["num_params"] == GPT(MODELS["tiny"][0], device="meta").num_params()
    assert (one["config"]["mp"], two["config"]["world_size"]) == (2, 4)


def test_the_split_is_a_function_of_the_names(tmp_path):
    """Membership does not depend on contents, on the other files or on the process (hash
    seed); the stdlib's validation share is 5% within 4 binomial standard deviations."""
    names = [f"pkg/mod{i}.py" for i in range(200)]
    train, val = split_names(names, 0.2)
    assert sorted(train + val) == sorted(names) and not set(train) & set(val)
    _, sub_val = split_names(names[::3], 0.2)
    assert sub_val and set(sub_val) == set(val) & set(names[::3])  # other files do not matter
    assert split_names(list(reversed(names)), 0.2)[1] == list(reversed(val))  # nor the order
    code = "from zero.workloads.data import split_names; import sys, json; " + (
        "print(json.dumps(split_names([f'pkg/mod{i}.py' for i in range(200)], 0.2)[1]))"
    )
    for seed in ("0", "123"):
        other = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )  # fmt: skip
        assert json.loads(other.stdout) == val, other.stderr

    # on disk: the corpus puts exactly split_names' files in validation; changing one file's
    # contents and adding a file moves no other file across the split
    def sizes(folder):
        return {p.name: p.stat().st_size for p in folder.iterdir()}

    for i in range(30):
        (tmp_path / f"f{i:02d}.txt").write_text(f"text {i}\n" * (100 + i))
    before, size_before = load_corpus(tmp_path, val_fraction=0.3), sizes(tmp_path)
    v_before = split_names(sorted(size_before), 0.3)[1]
    assert before.fingerprint["val_bytes"] == sum(size_before[f] for f in v_before) > 0
    (tmp_path / "f03.txt").write_text("other contents\n" * 500)
    (tmp_path / "new.txt").write_text("a new file\n" * 100)
    after, size_after = load_corpus(tmp_path, val_fraction=0.3), sizes(tmp_path)
    v_after = split_names(sorted(size_after), 0.3)[1]
    assert after.fingerprint["val_bytes"] == sum(size_after[f] for f in v_after)
    assert before.fingerprint["content_sha256"] != after.fingerprint["content_sha256"]
    assert set(v_after) - {"new.txt"} == set(v_before)

    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(p in ("test", "tests", "site-packages") for f in files for p in f.split("/"))
    t, v = split_names(files, 0.05)
    n, sigma = len(files), math.sqrt(len(files) * 0.05 * 0.95)
    assert abs(len(v) - 0.05 * n) < 4 * sigma, (len(v), n)
    corpus = load_corpus()
    size = {f: (stdlib_dir() / f).stat().st_size for f in files}
    assert corpus.fingerprint["val_bytes"] == sum(size[f] for f in v)
    assert corpus.fingerprint["train_bytes"] == sum(size[f] for f in t)


def test_micro_batches_are_a_pure_function_of_seed_step_and_index(text):
    """[Note: sampling]: the same (seed, step, j) gives the same batch whatever ran before;
    another j, step or seed gives another; targets are the inputs shifted by one."""
    corpus = load_corpus(text)

    def b(seed, step, j):
        return corpus.batch(split="train", seed=seed, index=(step, j), batch_size=4, seq_len=32)

    x, y = b(0, 5, 1)
    b(0, 0, 0), b(3, 9, 9)  # draws in between change nothing
    x2, y2 = b(0, 5, 1)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for other in (b(0, 5, 2), b(0, 6, 1), b(1, 5, 1)):
        assert not torch.equal(other[0], x)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--nproc", "2", "--micro-batches", "3"], "micro_batches"),
        (["--steps", "0"], "steps"),
        (["--lr", "-1"], "lr"),
        (["--eval-batches", "0"], "eval_batches"),
        (["--eval-every", "-1"], "eval_every"),
        (["--nproc", "0"], "nproc"),
        (["--val-fraction", "1.5"], "val_fraction"),
        (["--chunk", "100"], "chunk"),
        (["--offload-activations"], "offload_activations"),
        (["--mp", "3"], "mp"),  # the tiny GPT has 2 heads
        (["--mp", "2", "--nproc", "3"], "nproc"),
        (["--mp", "2", "--nproc", "4", "--micro-batches", "3"], "micro_batches"),
    ],
)
def test_bad_input_is_refused_by_name(tmp_path, argv, field, capsys):
    """A value the configuration refuses is an argparse error: exit 2, one line naming it."""
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f" {field}=" in err and len(err.splitlines()) == 1, err


def test_a_missing_corpus_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"^data="):
        main(["--data", "/nonexistent/corpus", "--out", str(tmp_path)])


@pytest.mark.parametrize(
    "argv, field", [(["--stage", "5"], "--stage"), (["--model", "huge"], "--model")]
)
def test_bad_choices_are_argparse_errors_naming_the_option(argv, field, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and field in capsys.readouterr().err


def test_every_option_is_explained_and_the_old_spellings_work(capsys):
    """--help gives every option a help text with its default; --fast and --timeout, the
    spellings in the README, still set the engine's mode and the run's limit."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for option in ("--stage", "--precision", "--steps", "--eval-every", "--bucket-elements"):
        assert option in text
    assert text.count("(default:") >= 30, text  # argparse may wrap after the colon
    cfg = parse(["--fast", "--timeout", "60", "--stage", "3", "--clip-norm", "none"])
    assert not cfg.zero.deterministic and cfg.timeout_s == 60 and cfg.zero.stage == 3
    assert cfg.zero.clip_norm is None and cfg.zero_config(2).micro_batches == 2


def test_evaluation_at_stage_3_with_batches_not_a_multiple_of_n(tmp_path, text):
    """3 validation batches on 2 ranks at stage 3: every rank runs 2 forwards (a forward gathers
    units there), the spare one left out of the mean. Before, rank 1 ran one forward fewer and
    the ranks' collectives went out of step (a hang until the timeout). The mean is of the
    same 3 batch losses as at N = 1, and each is near 5.5 nats: float32 values whose float64 sum
    is exact, so the two runs' validation losses must be equal."""
    args = [*FAST, "--data", str(text), "--steps", "1", "--eval-batches", "3", "--timeout", "60"]
    args += ["--micro-batches", "2"]  # the same training at N = 1 and 2
    two = main([*args, "--nproc", "2", "--stage", "3", "--out", str(tmp_path / "a")])
    one = main([*args, "--nproc", "1", "--stage", "0", "--out", str(tmp_path / "b")])
    assert two["result"]["history"]["val"] == one["result"]["history"]["val"]
