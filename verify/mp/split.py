"""The split rule of the model-parallel cells' reference side, stated again from the layers'
roles (docs/design.md §6.1), not taken from zero.mp, whose own table is under test: which of the
plain GPT's parameters splits how over N_m ranks (split_of), slice m of a whole array (cut), the
whole array from its slices (join, join_state), and which slice's copy enters the norm (counts).
Arrays only (numpy). verify/mp/cells.py's reference side and start check use it, and
verify/mp/resume.py joins the slices' saved states with it.
"""

from __future__ import annotations

import numpy as np

COLUMN = {"attn.c_attn": "qkv", "mlp.c_fc": "rows"}
"""Column-parallel layers (docs/design.md §6.1): output features split, the weight's rows and the
bias with them; QKV by heads, i.e. each of the q, k and v blocks in N_m parts."""
ROW = ("attn.c_proj", "mlp.c_proj")
"""Row-parallel layers: input features split (the weight's columns); the bias is added once,
after the sum, so it is replicated."""
VOCAB = ("transformer.wte", "lm_head")
"""The token embedding and its tied head: split by vocabulary rows."""


def split_of(name: str) -> str | None:
    """How design §6.1 splits the plain GPT's parameter `name` over N_m ranks: "rows" (dim 0 in
    N_m equal parts), "cols" (dim 1), "qkv" (dim 0 as q, k, v, each in N_m parts) or None
    (replicated). Restated from the layers' roles: zero.mp's own table is under test."""
    module, _, kind = name.rpartition(".")
    role = ".".join(module.split(".")[-2:])
    if role in COLUMN:
        return COLUMN[role]
    if role in ROW:
        return "cols" if kind == "weight" else None
    return "rows" if module in VOCAB else None


def cut(a: np.ndarray, rule: str | None, m: int, n: int) -> np.ndarray:
    """Slice m of n of a whole array split by `rule` (split_of); a contiguous copy."""
    if rule == "qkv":
        return np.concatenate([np.split(third, n)[m] for third in np.split(a, 3)])
    if rule is not None:
        a = np.split(a, n, axis=0 if rule == "rows" else 1)[m]
    return np.ascontiguousarray(a).copy()


def join(parts: list[np.ndarray], rule: str | None, name: str = "") -> np.ndarray:
    """The whole array from its slices in m order (cut's inverse). A replicated array must have
    the same bits in every slice (ValueError naming it otherwise)."""
    if rule is None:
        if any(not bits_equal(x, parts[0]) for x in parts):
            raise ValueError(f"{name}: replicated, but the MP slices hold different bits")
        return parts[0]
    if rule == "qkv":
        thirds = [np.split(x, 3) for x in parts]
        return np.concatenate([np.concatenate([t[j] for t in thirds]) for j in range(3)])
    return np.concatenate(parts, axis=0 if rule == "rows" else 1)


def join_state(slices: list[dict]) -> dict:
    """name -> whole array, from every slice's name -> array, in m order."""
    return {k: join([s[k] for s in slices], split_of(k), k) for k in slices[0]}


def counts(name: str, m: int) -> bool:
    """reference/mp.py's `counts`: whether slice m's `name` enters the norm. Design §6.3: every
    element of the model once, so a split parameter on every m, a replicated one on m = 0."""
    return split_of(name) is not None or m == 0


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.array_equal(
            np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
        )
    )
