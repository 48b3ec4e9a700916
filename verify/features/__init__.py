"""The feature registry: each option verify checks, declared once (verify/features/record.py).

    FEATURES            name -> Feature, in the order below (a cell's features sort this way)
    parse_features      a cell's features as given -> the canonical tuple, refused by name
    config_of           the ZeroConfig fields a tuple of features sets
    builder             the model a base model key becomes under a cell's features
    cells_for(preset)   the cells the features add ("quick" or "complete")
    resume_rows(sizes)  the resume rows they add for these world sizes
    pairs / bugs / branches / traffic_checks / arrangers   their parts, over every feature

Every reader of a feature's facts (verify/cells/: cell.py's Cell, matrix.py's presets,
observable.py's --list, interactions.py; planted/suite.py, checkpoints/resume.py,
checks/harness.py) goes through these; docs/verification.md
("Adding a feature") says what a new option takes: one module here and its line below.
"""

from __future__ import annotations

from . import (
    bucket_elements,
    checkpointing,
    contiguous,
    dcp,
    disk,
    dropout,
    frozen,
    hpz,
    hsdp,
    mp,
    nodes,
    offload,
    offload_activations,
    qgz,
    qwz,
    release_grads,
    watchdog_mode,
)
from .record import CHECKS, RESUME_CHECKS, Bug, Feature, Pair

FEATURES: dict[str, Feature] = {
    m.FEATURE.name: m.FEATURE
    for m in (
        offload,
        disk,
        checkpointing,
        offload_activations,
        contiguous,
        release_grads,
        bucket_elements,
        frozen,
        dropout,
        watchdog_mode,
        nodes,
        hpz,
        hsdp,
        qwz,
        qgz,
        dcp,
        mp,
    )
}

__all__ = ["CHECKS", "FEATURES", "RESUME_CHECKS", "Bug", "Feature", "Pair"]


def _split(item: str) -> tuple[str, str | None]:
    name, eq, text = item.partition("=")
    return name, (text if eq else None)


def parse_features(given) -> tuple[str, ...]:
    """The canonical tuple of `given` (names, "name=value" for the features with a value): in
    registry order, each once; an unknown name, a value where none is taken or missing, or a
    feature verified in its own section refused by name."""
    if isinstance(given, str):
        raise ValueError(f"features={given!r}: a tuple of names, e.g. ('offload', 'disk')")
    seen: dict[str, str] = {}
    for item in given:
        name, text = _split(str(item))
        f = FEATURES.get(name)
        if f is None:
            raise ValueError(f"features: {item!r} is not a feature; allowed are {list(FEATURES)}")
        if f.section:
            raise ValueError(
                f"features: {name!r} is verified in its own section (python -m verify "
                f"--{f.section}), not in cells"
            )
        if (text is None) != (f.parse is None):
            form = f"'{name}=<value>'" if f.parse else f"'{name}' without a value"
            raise ValueError(f"features: {item!r}; allowed is {form}")
        if text is not None:
            f.parse(text)  # refuses a bad value by name
        if name in seen:
            raise ValueError(f"features: {name!r} given twice ({seen[name]!r}, {item!r})")
        seen[name] = str(item)
    order = list(FEATURES)
    return tuple(seen[n] for n in sorted(seen, key=order.index))


def value_of(features: tuple[str, ...], name: str):
    """What `cell.<name>` reads: the parsed value, True for a flag, the feature's `absent`."""
    f = FEATURES[name]
    for item in features:
        key, text = _split(item)
        if key == name:
            return True if text is None else f.parse(text)
    return f.absent


def config_of(features: tuple[str, ...]) -> dict:
    """The ZeroConfig fields these features set, each feature's own."""
    out: dict = {}
    for item in features:
        name, text = _split(item)
        f = FEATURES[name]
        out.update(f.config(True if text is None else f.parse(text)))
    return out


def check(cell) -> None:
    """Each feature's needs on this cell, refused by name."""
    for item in cell.features:
        name, _ = _split(item)
        f = FEATURES[name]
        why = f.needs(cell) if f.needs is not None else ""
        if not why and f.models is not None and cell.model not in f.models:
            why = f"it changes the model {sorted(f.models)}, not model={cell.model!r}"
        if why:
            raise ValueError(f"features: {name!r} with this cell: {why}")


def builder(model: str, features: tuple[str, ...]):
    """build(device=None) of the base model `model` under these features, or None for the base
    model's own (at most one feature changes a model: check() allows only listed models)."""
    for item in features:
        f = FEATURES[_split(item)[0]]
        if f.models is not None:
            return f.models[model]
    return None


def names(features: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_split(item)[0] for item in features)


def cells_for(preset: str) -> list[dict]:
    """The Cell fields of the cells the features add to a preset ("quick": their quick cells;
    "complete": quick and complete)."""
    if preset not in ("quick", "complete"):
        raise ValueError(f"preset={preset!r}: allowed are 'quick', 'complete'")
    out = []
    for f in FEATURES.values():
        out += list(f.quick) + (list(f.complete) if preset == "complete" else [])
    return out


def resume_rows(sizes) -> list[dict]:
    """The ResumeCase fields of the rows the features add, where `sizes` has the world sizes
    each row needs."""
    return [dict(row) for f in FEATURES.values() for need, row in f.resume if set(need) <= sizes]


def pairs() -> list[Pair]:
    return [p for f in FEATURES.values() for p in f.pairs]


def bugs() -> list[Bug]:
    return [b for f in FEATURES.values() for b in f.bugs]


def branches() -> dict:
    return {k: v for f in FEATURES.values() for k, v in (f.branches or {}).items()}


def traffic_checks() -> list:
    """traffic(ref_config, spec, n, skipped) of every feature that counts bytes of its own."""
    return [f.traffic for f in FEATURES.values() if f.traffic is not None]


def checkpoint_of(features: tuple[str, ...]):
    """The checkpoint format a resume row's features ask for (Feature.checkpoint), or None for
    the native one."""
    found = [f.checkpoint for n in names(features) if (f := FEATURES[n]).checkpoint is not None]
    return found[0] if found else None


def arrangers(features: tuple[str, ...]) -> list:
    return [f.arrange for n in names(features) if (f := FEATURES[n]).arrange is not None]
