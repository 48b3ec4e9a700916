"""Where verify's expected values come from (docs/verification.md, "Where expected values come
from"): never from the code under test, library helpers included.

Every import of the library (zero.*) in the modules that build expected values is listed in
IMPORTS with its kind and why:
  a  the code under test or a read of its state: compared, never used as the expected value
  b  the input under test: model definition, configuration, data, process groups; both sides
     consume the same input
  c  a documented re-statement that the engine does not use, so it cannot move with it
The scanner reads each module's syntax tree (imports inside functions included, and names a
module takes from a sibling verify module that itself imported them from zero), so a new import
fails here until it is classified, and an entry that matches no import fails as stale. The
parameter groups are the case that started this: the reference side once called
zero.config.decay_matrices_only, the predicate the engine's config hands it; it now reads
verify.checks.expect.GROUPINGS, checked below against the models and the library.
"""

import ast
from pathlib import Path

import pytest
import torch

from verify.cells.cell import MODELS
from verify.checks import expect
from verify.mp import lockstep as mp_lockstep
from verify.parity import section as parity
from zero.config import decay_matrices_only

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("a", "b", "c")
MP_SOURCE = "the MP context's counter, a required argument; nothing is read from it"
MODEL = "the model's definition, built alike for the engine and the expected side"
DATA = "the data both sides train on"
POOL = "where the ranks run; no value is compared or expected"
IMPORTS = {
    ("verify/checks/expect_memory.py", "zero.common.memory.model_state_breakdown"): (
        "c", "docs/design.md §3's bytes per category; the engine never calls it (tested below)"),
    ("verify/parity/section.py", "zero.config.ZeroConfig"): ("b", "the engine's configuration"),
    ("verify/parity/section.py", "zero.config.decay_matrices_only"): (
        "b", "the engine config's group_of; the plain side's groups are expect.decay_groups"),
    ("verify/parity/section.py", "zero.engine.ZeroEngine"): (
        "a", "the engine under test: gather_state and its step's results are compared"),
    ("verify/parity/section.py", "zero.workloads.lora.add_lora"): ("b", MODEL),
    ("verify/parity/hf_leg.py", "zero.checkpoint.export_hf"): (
        "a", "under test: its folder is read back by transformers and compared with the master"),
    ("verify/parity/hf_leg.py", "zero.checkpoint.init_from_hf"): (
        "a", "under test: the engine it fills is compared with the exporting engine's master"),
    ("verify/parity/hf_leg.py", "zero.checkpoint.meta_model"): (
        "a", "under test: the fresh engine's model; its values come from init_from_hf"),
    ("verify/parity/hf_leg.py", "zero.engine.ZeroEngine"): ("a", "the engine under test"),
    ("verify/parity/section.py", "zero.workloads.resnet.ResNet"): ("b", MODEL),
    ("verify/parity/section.py", "zero.workloads.resnet.ResNetConfig"): ("b", MODEL),
    ("verify/mp/lockstep.py", "zero.collectives.CommCounter"): ("b", MP_SOURCE),
    ("verify/mp/lockstep.py", "zero.mp.MPContext"): ("b", "the MP group the operators run in"),
    ("verify/mp/lockstep.py", "zero.mp.layers"): (
        "a", "the tensor-parallel operators under test; outputs and gradients compared"),
    ("verify/mp/lockstep.py", "zero.mp.tp_comm"): (
        "a", "patched by the plants only; its sums run inside the operators under test"),
    ("verify/mp/lockstep.py", "zero.mp.split_rule"): (
        "b", "the partition (which layer splits how); a wrong one breaks mp_cells' TP GPT"),
    ("verify/mp/lockstep.py", "zero.mp.split_state"): (
        "b", "rank m's slice of the weights, the operators' input; it names the rank's elements"),
    ("verify/mp/lockstep.py", "zero.workloads.models.GPT"): ("b", MODEL + " (values redrawn)"),
    ("verify/mp/lockstep.py", "zero.workloads.models.GPTConfig"): ("b", MODEL),
    ("verify/mp/lockstep.py", "zero.workloads.models.gpt_microbatches"): ("b", DATA),
    # verify/mp/cells.py and verify/mp/resume.py: as their owner left them on this table's date
    ("verify/mp/cells.py", "zero.collectives.CommCounter"): (
        "a", "the engine's traffic counter, read and compared with verify.checks.expect"),
    ("verify/mp/cells.py", "zero.config.TORCH_DTYPES"): (
        "b", "the torch dtype a precision name means: the cast both sides apply"),
    ("verify/mp/cells.py", "zero.config.ZeroConfig"): ("b", "the engine's configuration"),
    ("verify/mp/cells.py", "zero.engine.ZeroEngine"): ("a", "the engine under test"),
    ("verify/mp/cells.py", "zero.mp.MPContext"): ("b", "the MP group the engine runs in"),
    ("verify/mp/cells.py", "zero.mp.Mesh"): ("b", "the (N_d, N_m) mesh's process groups"),
    ("verify/mp/cells.py", "zero.mp.TPGPT"): ("b", MODEL),
    ("verify/mp/cells.py", "zero.mp.gpt"): ("a", "patched by the tp_scale plant only"),
    ("verify/mp/cells.py", "zero.mp.partitioned"): ("a", "patched by the p_a_order plant only"),
    ("verify/mp/cells.py", "zero.mp.tp_num_params"): (
        "a", "under test: compared with the count of the cut GPT (_count_check)"),
    ("verify/mp/cells.py", "zero.workloads.models.GPT"): ("b", MODEL),
    ("verify/mp/cells.py", "zero.workloads.models.GPTConfig"): ("b", MODEL),
    ("verify/mp/cells.py", "zero.workloads.models.gpt_microbatches"): ("b", DATA),
    ("verify/mp/resume.py", "zero.checkpoint.consolidate"): (
        "a", "under test: the consolidated checkpoint is compared with the saved state"),
    ("verify/mp/resume.py", "zero.checkpoint.mpjoin"): (
        "a", "patched by the reversed-join plant only"),
    ("verify/mp/resume.py", "zero.collectives.CommCounter"): ("b", MP_SOURCE),
    ("verify/mp/resume.py", "zero.config.ZeroConfig"): ("b", "the engine's configuration"),
    ("verify/mp/resume.py", "zero.engine.ZeroEngine"): ("a", "the engine under test"),
    ("verify/mp/resume.py", "zero.mp.MPContext"): ("b", "the MP group the engine runs in"),
    ("verify/mp/resume.py", "zero.mp.TPGPT"): ("b", MODEL),
    ("verify/mp/resume.py", "zero.ranks.launch.under_torchrun"): ("b", POOL),
    ("verify/mp/resume.py", "zero.ranks.local.get_pool"): ("b", POOL),
    ("verify/mp/resume.py", "zero.workloads.models.GPT"): ("b", MODEL),
    ("verify/mp/resume.py", "zero.workloads.models.GPTConfig"): ("b", MODEL),
    ("verify/mp/resume.py", "zero.workloads.models.gpt_microbatches"): ("b", DATA),
}  # fmt: skip
"""(verify module, imported zero name) -> (kind, why)."""
EXPECTED_SIDE = ("checks/expect*.py", "checks/lockstep.py", "checks/bounds.py", "checks/verdict.py",
                 "parity/*.py", "mp/*.py")  # fmt: skip
MODULES = sorted(
    {m for m, _ in IMPORTS}
    | {p.relative_to(ROOT).as_posix() for g in EXPECTED_SIDE for p in (ROOT / "verify").glob(g)}
)
"""The modules that state expected values or check against them: verify/checks/' expectations,
bounds and verdict, and every module of verify/parity/ and verify/mp/, found on disk, so that a
module added there (or split out of an expect*.py) is scanned without being listed. The harness
and its sides (verify/checks/harness.py, sides.py) drive the engine: they are the side under
test and its inputs."""


def _is_zero(module: str | None) -> bool:
    return module is not None and (module == "zero" or module.startswith("zero."))


def zero_bindings(source: str) -> dict[str, str]:
    """Every name a module's imports bind from the library, at any depth (imports inside
    functions included): {bound name: "zero.x.name"} for `from zero.x import name [as b]`,
    {"zero.x" or its alias: "zero.x"} for `import zero.x [as b]`."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_zero(node.module):
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            out.update({a.asname or a.name: a.name for a in node.names if _is_zero(a.name)})
    return out


def zero_imports(source: str, sibling=lambda name: "", package: str = "") -> set[str]:
    """The zero.* names a module imports: its own imports, and the names it takes from another
    verify module (`from .expect import x`, `from ..cells.cell import x`, `from verify.x import
    y`) that are that module's zero imports. package: the importing module's package under
    verify ("checks", "" at the top), against which relative imports resolve. sibling(dotted
    name under verify) -> that module's source ('' when there is none)."""
    found = set(zero_bindings(source).values())
    parts = package.split(".") if package else []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.level:
            base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
            name = ".".join([*base, node.module])
        elif node.module.startswith("verify."):
            name = node.module.removeprefix("verify.")
        else:
            continue
        theirs = zero_bindings(sibling(name))
        found |= {theirs[a.name] for a in node.names if a.name in theirs}
    return found


def package_of(module: str) -> str:
    """ "checks" for verify/checks/expect.py; "" for a module at verify/'s top."""
    return ".".join(Path(module).parent.parts[1:])


def verify_source(name: str) -> str:
    path = ROOT / "verify" / f"{name.replace('.', '/')}.py"
    return path.read_text() if path.exists() else ""


def unclassified(module: str, source: str, sibling=verify_source) -> list[str]:
    """The zero.* names `module` imports that IMPORTS does not classify."""
    found = zero_imports(source, sibling, package_of(module))
    return sorted(x for x in found if (module, x) not in IMPORTS)


def test_every_zero_import_of_the_expected_side_is_classified():
    missing = {m: unclassified(m, (ROOT / m).read_text()) for m in MODULES}
    assert not {m: x for m, x in missing.items() if x}, missing


def test_no_entry_is_stale():
    found = {
        (m, x)
        for m in MODULES
        for x in zero_imports((ROOT / m).read_text(), verify_source, package_of(m))
    }
    assert not sorted(set(IMPORTS) - found)


def test_every_entry_has_a_kind_and_a_reason():
    for key, (kind, why) in IMPORTS.items():
        assert kind in KINDS and why.strip(), key


def test_the_scanner_reports_a_planted_expected_side_import():
    """The bug that started this: the reference side calling the library's predicate, imported
    inside a function, or taken from a sibling module that imported it."""
    direct = "def reference_groups(model):\n    from zero.config import decay_matrices_only\n"
    assert unclassified("verify/checks/expect.py", direct) == ["zero.config.decay_matrices_only"]
    aliased = "import zero.config as zc\n"
    assert unclassified("verify/checks/expect.py", aliased) == ["zero.config"]
    cell = {"cells.cell": "from zero.config import ZeroConfig, decay_matrices_only\nGROUPS = {}\n"}
    for via in ("from ..cells.cell import GROUPS, decay_matrices_only\n",
                "def f():\n    from verify.cells.cell import decay_matrices_only\n"):  # fmt: skip
        got = unclassified("verify/parity/anchors.py", via, lambda m: cell.get(m, ""))
        assert got == ["zero.config.decay_matrices_only"], via
    plain = "from ..cells.cell import GROUPS\n"
    assert unclassified("verify/parity/anchors.py", plain, lambda m: cell.get(m, "")) == []


def test_the_memory_formula_is_not_the_engines():
    """Kind c for model_state_breakdown holds while no engine code calls it: memory_report must
    count the engine's real buffers, or the formula would be checked against itself."""
    users = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "zero").rglob("*.py")
        if "model_state_breakdown" in p.read_text() and p.name != "memory.py"
    ]
    assert users == []


# -- the parameter groups (verify.checks.expect.GROUPINGS)
# ---------------------------------------------


def _models():
    out = {k: build() for k, (build, _) in MODELS.items()}
    for name in ("resnet", "lora", "gpt2", "llama"):
        family = parity.FAMILIES[name]
        if family.missing() is None:
            out[name] = family.build()
    return out


def test_every_verify_model_has_a_stated_grouping_with_both_groups():
    for name, model in _models().items():
        groups = expect.decay_groups(model)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert sorted(groups) == sorted(trainable), name
        assert set(groups.values()) == ({0} if name == "lora" else {0, 1}), name


def test_the_library_predicate_agrees_with_the_stated_table():
    """The unit-level form of the planted decay_rule_vectors: zero.config's predicate (under
    test here) must put every verify model's parameters where the table says."""
    for name, model in _models().items():
        got = {n: decay_matrices_only(n, p) for n, p in model.named_parameters() if p.requires_grad}
        assert got == expect.decay_groups(model), name


def test_a_wrong_predicate_differs_from_the_table():
    model = MODELS["gpt"][0]()
    wrong = {n: 0 if p.ndim >= 1 else 1 for n, p in model.named_parameters()}  # the plant's
    assert expect.group_mismatch(wrong, expect.decay_groups(model)).startswith("parameter groups")
    assert expect.group_mismatch(expect.decay_groups(model), expect.decay_groups(model)) == ""


def test_an_unknown_model_or_an_ambiguous_row_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="no grouping stated"):
        expect.decay_groups(torch.nn.Linear(2, 2))
    both = (("layers.*",), ("layers.*.bias",))
    monkeypatch.setitem(expect.GROUPINGS, "MLP", both)
    with pytest.raises(ValueError, match="matches groups"):
        expect.decay_groups(MODELS["mlp"][0]())


def test_reference_groups_without_group_of_put_everything_in_group_0():
    model = MODELS["mlp"][0]()
    config = type("Config", (), {"group_of": None})()
    assert set(expect.reference_groups(model, config).values()) == {0}


# -- the operator lock-step's start values -------------------------------------------------------


def test_the_lockstep_gpt_has_random_biases_and_norms():
    """A bias added on every MP rank (N_m·b) is invisible while b = 0; the GPT's own start
    has zero biases and unit LayerNorm scales, so mp_lockstep.redraw replaces every value."""
    from zero.workloads.models import GPT, GPTConfig

    model, again = (GPT(GPTConfig(**mp_lockstep.CFG), seed=3) for _ in range(2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(not p.any() for n, p in before.items() if n.endswith(".bias"))
    mp_lockstep.redraw(model)
    mp_lockstep.redraw(again)  # every MP rank redraws the same values
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert not torch.equal(p, before[n]) and bool((p != 0).all()), n
        assert torch.equal(p, q), n
