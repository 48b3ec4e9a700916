"""Command lines derived from keyword-only dataclasses: one declaration per configuration.

`parse(Config, argv)` gives every field an option `--field-name` whose help is the field's
docstring (the string literal after it in the class body) with its default, and builds the
dataclass back from the parsed options, so that its `__post_init__` validates: a ValueError
there becomes an argparse error (exit 2, one line naming the field). A field holding a dataclass
is merged: its fields become options of their own. Types: int, float, str, bool
(--flag/--no-flag), `X | None` (the word 'none' gives None), tuple[X, ...] (several values),
dict (JSON) and Literal (choices); `choices` gives the known set of any other field.
`run(main, prog)` is every CLI's entry point: a ValueError anywhere in main (bad input found
after parsing) ends the process the way argparse does, `prog: error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import os
import re
import sys
import types
import typing


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: its docstring, whitespace collapsed} of a dataclass and of its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        body = ast.parse(inspect.getsource(klass).lstrip()).body[0].body
        for stmt, after in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    docs[stmt.target.id] = " ".join(str(after.value.value).split())
    return docs


def _none_or(convert):
    def parse(text: str):
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _option(hint, default, choices) -> dict:
    """argparse keywords for a field of type `hint`."""
    args = typing.get_args(hint)
    optional = type(None) in args and typing.get_origin(hint) in (typing.Union, types.UnionType)
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
        args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is typing.Literal:
        choices, hint = args, type(args[0])
    kw: dict = {}
    if origin in (tuple, list):
        kw["nargs"], hint = "+", args[0]
    if hint is dict or typing.get_origin(hint) is dict:
        kw["type"], kw["metavar"] = json.loads, "JSON"
    elif hint in (int, float, str):
        kw["type"] = hint
    else:
        raise TypeError(f"no command-line option for type {hint!r}; exclude the field")
    if choices is not None:
        kw["choices"] = tuple(choices) + ((None,) if optional else ())
    if optional:
        kw["type"] = _none_or(kw["type"])
    return kw


def add_fields(parser, cls, *, default=None, exclude=(), choices=None, aliases=None, _path=""):
    """Add an option per field of `cls` (defaults from the instance `default`, else cls's own);
    returns build(namespace) -> the dataclass. exclude/choices/aliases are keyed by dotted path
    ('zero.stage'); aliases gives further option strings of a field."""
    choices, aliases = choices or {}, aliases or {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    builders = {}
    for f in dataclasses.fields(cls):
        path = _path + f.name
        if path in exclude or not f.init:
            continue
        if default is not None:
            value = getattr(default, f.name)
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        if dataclasses.is_dataclass(hints[f.name]):
            title = f"{path} ({hints[f.name].__name__}): {docs.get(f.name, '')}"
            builders[f.name] = add_fields(
                parser.add_argument_group(title.replace("%", "%%")), hints[f.name], default=value,
                exclude=exclude, choices=choices, aliases=aliases, _path=path + ".",
            )  # fmt: skip
            continue
        kw = _option(hints[f.name], value, choices.get(path))
        help_text = docs.get(f.name, "").replace("%", "%%")
        shown = ", ".join(map(str, kw.get("choices", ())))
        if kw.get("action") is None and (not shown or len(shown) > 30):
            kw["metavar"] = kw.get("metavar", f.name.upper())
            help_text += f" Choices: {shown}." if shown else ""
        if value is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = value
            help_text += f" (default: {_show(value)})"
        names = ["--" + f.name.replace("_", "-"), *aliases.get(path, ())]
        parser.add_argument(*names, dest=path, help=help_text, **kw)
        builders[f.name] = path

    def build(ns):
        def value(how):
            got = how(ns) if callable(how) else getattr(ns, how)
            return tuple(got) if isinstance(got, list) else got

        kwargs = {k: value(how) for k, how in builders.items()}
        return cls(**kwargs) if default is None else dataclasses.replace(default, **kwargs)

    return build


def _show(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    return str(value).replace("%", "%%")


def new_parser(prog: str | None, description: str | None) -> argparse.ArgumentParser:
    """An empty parser in the style of these CLIs: a one-line usage, the description as written."""
    return argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [options]",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parse(cls, argv=None, *, parser=None, description=None, prog=None, **options):
    """(the dataclass, the namespace) of a command line; `parser` may carry further options
    that are not fields (they stay in the namespace). `options` go to add_fields."""
    parser = new_parser(prog, description) if parser is None else parser
    build = add_fields(parser, cls, **options)
    ns = parser.parse_args(argv)
    try:
        return build(ns), ns
    except ValueError as exc:
        msg = error_line(exc)
        named = re.match(r"(\w+)=", msg)
        where = f"argument --{named.group(1).replace('_', '-')}: " if named else ""
        parser.exit(2, f"{parser.prog}: error: {where}{msg}\n")


def is_real(value) -> bool:
    """A finite real number (an int or a float, not a bool): what every numeric field needs
    before its range is checked (inf and nan pass most range checks)."""
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def error_line(exc: BaseException) -> str:
    """An exception's message on one line (whitespace collapsed)."""
    return " ".join(str(exc).split())


def run(main, prog: str, argv=None, *, refuse=(ValueError,)):
    """Run a CLI's `main(argv)` and exit: its int return value is the exit status (anything
    else: 0). A ValueError (bad input: every message names the field, the value and what is
    allowed) becomes one line, `prog: error: MESSAGE`, and exit status 2, with no traceback,
    as argparse's own errors do. SIGINT or SIGTERM (zero.ranks.signals.Interrupted, or a plain
    KeyboardInterrupt) becomes one line and exit status 128 + the signal (130, 143). Other
    exceptions keep their traceback: they are bugs or faults, not input. A torchrun rank whose
    main returned leaves its process group (zero.ranks.launch.leave_world) before exiting."""
    try:
        code = main(argv)
    except refuse as exc:
        print(f"{prog}: error: {error_line(exc)}", file=sys.stderr)
        _exit(2)
    except KeyboardInterrupt as exc:
        status = getattr(exc, "exit_status", 130)
        # on a line of its own: a progress bar or a terminal's ^C may have left one unfinished
        print(f"\n{prog}: {error_line(exc) or 'interrupted (SIGINT)'}", file=sys.stderr)
        _exit(status)
    except Exception as exc:
        _say_whom_to_blame(exc, prog)
        if not _stranded():
            raise
        sys.excepthook(*sys.exc_info())  # the traceback, and torchrun's error files
        _exit(1)
    _leave_world()
    _exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


def _stranded() -> bool:
    watchdog = sys.modules.get("zero.ranks.watchdog")
    return watchdog is not None and watchdog.stranded()


def _exit(code: int):
    """sys.exit(code); but where a collective is left in flight for a peer named as stopped
    ([Note: a stopped rank named in seconds] in zero/ranks/watchdog.py), the interpreter's own
    exit would wait for that peer in gloo's teardown: then the exit handlers run (the disk
    tier's state files go, the heartbeat says why), the output is flushed, and the process ends
    at once."""
    if not _stranded():
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _leave_world() -> None:
    # Only where torch.distributed is loaded at all: most CLIs never import it.
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        from ..ranks.launch import leave_world

        leave_world()


def _say_whom_to_blame(exc: BaseException, prog: str) -> None:
    """A fault the watchdog explained (zero/ranks/watchdog.py): its blame line goes last on stderr,
    under the traceback, and into torchrun's error file, whose first failure torchrun prints
    in its summary; so the rank to blame is what a user reads first, not only the rank that
    reported it."""
    lines = [x for x in str(exc).splitlines() if x.lstrip().startswith("watchdog blames")]
    if not lines:
        return
    print(f"{prog}: error: {lines[0].strip()}", file=sys.stderr)
    record_for_torchrun(exc)


def record_for_torchrun(exc: BaseException) -> None:
    """Under torchrun: `exc` into this rank's error file, and the watchdog's report into the
    files of the ranks it blames (zero.ranks.launch.record_blamed), whose first failure
    torchrun's summary names. Nothing outside torchrun; never raises."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            from ..ranks.launch import record_blamed

            ErrorHandler().record_exception(exc)
            record_blamed(exc)  # and the blamed ranks' own files: torchrun names them first
        except Exception:
            pass  # the summary then shows the exit code only; the message is on stderr


def check_writable(name: str, path, *, file: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written: `path` a folder (created
    later if missing) or, with file=True, a file. The nearest existing folder on the way must be
    a writable directory (tried with a temporary file, which holds for root too), and nothing on
    the way may be a file."""
    import tempfile
    from pathlib import Path

    p = Path(path)
    if p.exists() and p.is_dir() == file:
        what = "a folder" if file else "a file"
        raise ValueError(f"{name}={str(path)!r}: is {what}; allowed is a writable {_kind(file)}")
    probe = p.parent if file else p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(
            f"{name}={str(path)!r}: {str(probe)!r} is not a folder; allowed is a writable "
            f"{_kind(file)}"
        )
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(
            f"{name}={str(path)!r}: cannot write in {str(probe)!r} ({reason}); allowed is a "
            f"writable {_kind(file)}"
        ) from None


def _kind(file: bool) -> str:
    return "file path" if file else "folder"
