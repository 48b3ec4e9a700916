"""zero.common.cli: command lines derived from keyword-only dataclasses (one declaration per
config)."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from zero.common import cli
from zero.config import ZeroConfig


@dataclass(frozen=True, kw_only=True)
class Inner:
    """An inner configuration, merged into the outer one's options."""

    width: int = 4
    """Width of the thing (100% of it)."""
    shape: dict | None = None
    """JSON, or none."""


@dataclass(frozen=True, kw_only=True)
class Outer:
    """A configuration of every supported kind of field."""

    steps: int = 3
    """Steps to take; at least 1."""
    rate: float | None = 0.5
    """A rate, or None."""
    name: str = "a"
    """A name."""
    mode: Literal["x", "y"] = "x"
    """One of two modes."""
    flag: bool = True
    """A flag."""
    sizes: tuple[int, ...] = (1, 2)
    """Several sizes."""
    inner: Inner = Inner(width=8)
    """The inner part."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps!r}: allowed are integers >= 1")


def _parser():
    return argparse.ArgumentParser(prog="prog", usage="%(prog)s [options]")


def test_every_field_gets_an_option_with_its_docstring_as_help():
    parser = _parser()
    cli.add_fields(parser, Outer)
    docs = {**cli.field_docs(Outer), **cli.field_docs(Inner)}
    options = {a.dest: a for a in parser._actions if a.dest != "help"}
    leaves = [f.name for f in dataclasses.fields(Outer) if f.name != "inner"]
    assert set(options) == {*leaves, "inner.width", "inner.shape"}
    for dest, action in options.items():
        doc = docs[dest.split(".")[-1]]
        assert doc and action.help.startswith(doc.replace("%", "%%")), (dest, action.help)
        assert "(default: " in action.help
    assert options["mode"].choices == ("x", "y")
    assert options["flag"].option_strings == ["--flag", "--no-flag"]
    assert options["inner.width"].default == 8  # from the outer default instance
    text = parser.format_help()
    assert "Width of the thing (100% of it). (default: 8)" in " ".join(text.split())


def test_the_namespace_builds_the_dataclass_built_directly():
    argv = ["--steps", "5", "--rate", "none", "--mode", "y", "--no-flag", "--sizes", "3", "4"]
    argv += ["--width", "16", "--shape", '{"n": 1}']
    got, ns = cli.parse(Outer, argv)
    want = Outer(
        steps=5,
        rate=None,
        mode="y",
        flag=False,
        sizes=(3, 4),
        inner=Inner(width=16, shape={"n": 1}),
    )
    assert got == want and ns.steps == 5
    assert cli.parse(Outer, [])[0] == Outer()


def test_zero_config_round_trips():
    """Every ZeroConfig field a command line can carry is documented and round-trips."""
    exclude = ("groups", "group_of", "scaler", "units")
    argv = ["--stage", "3", "--precision", "bf16", "--no-deterministic", "--clip-norm", "2.5"]
    argv += ["--bucket-elements", "4096", "--activation-checkpointing", "--offload-activations"]
    got, _ = cli.parse(ZeroConfig, argv, exclude=exclude)
    assert got == ZeroConfig(
        stage=3,
        precision="bf16",
        deterministic=False,
        clip_norm=2.5,
        bucket_elements=4096,
        activation_checkpointing=True,
        offload_activations=True,
    )
    docs = cli.field_docs(ZeroConfig)
    assert all(docs.get(f.name) for f in dataclasses.fields(ZeroConfig)), docs


def test_a_bad_value_exits_2_naming_the_field(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse(Outer, ["--steps", "0"], prog="prog")
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == "prog: error: argument --steps: steps=0: allowed are integers >= 1\n"


def test_extra_options_stay_in_the_namespace_and_unsupported_types_are_refused():
    parser = _parser()
    parser.add_argument("--json", default=None)
    cfg, ns = cli.parse(Outer, ["--json", "out.json"], parser=parser)
    assert cfg == Outer() and ns.json == "out.json"
    with pytest.raises(TypeError, match="exclude the field"):
        cli.add_fields(_parser(), ZeroConfig)  # groups, group_of: no command line for them
