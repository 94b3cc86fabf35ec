"""The shape docs/architecture.md promises: a trainer that only sequences, short functions, no citations of files
outside the repository, one definition of the text of a completion, and imports that follow the data."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo"


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_the_trainer_stays_short():
    """The trainer only sequences (docs/architecture.md): at most 350 lines, none hidden from the formatter and
    none holding two statements."""
    source = (PACKAGE / "training" / "trainer.py").read_text()
    lines = len(source.splitlines())
    assert lines <= 350, f"grpo/training/trainer.py has {lines} lines; move logic into the module of its stage"
    assert "fmt: skip" not in source and "fmt: off" not in source, "grpo/training/trainer.py hides lines from ruff"
    assert not _lines_with_two_statements(source), f"two statements on a line: {_lines_with_two_statements(source)}"


def _lines_with_two_statements(source: str) -> list[int]:
    """The line numbers on which two statements start (`a = 1; b = 2`, `if x: y = 1`)."""
    starts = [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.stmt)]
    return sorted({line for line in starts if starts.count(line) > 1})


def test_two_statements_on_a_line_are_found():
    assert _lines_with_two_statements("a = 1\nb = 2; c = 3\nif a: d = 4\n") == [2, 3]


def test_the_trainer_never_names_a_loss_type():
    """What a loss_type decides (its term, aggregation, normaliser, accumulation scaling) is chosen in
    grpo/objective/loss_types.py's table and read by grpo/objective/loss.py."""
    from grpo.objective.loss_types import LOSS_TYPES

    source = (PACKAGE / "training" / "trainer.py").read_text()
    named = re.findall(rf"[\"']({'|'.join(LOSS_TYPES)})[\"']", source)
    assert not named, f"grpo/training/trainer.py names loss types {named}: ask grpo/objective/loss.py instead"


def test_no_function_is_longer_than_60_lines():
    """Docstring included; a function may be longer only where its docstring says why ("Longer than 60 lines: ...")."""
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, length, doc in _functions_with_docstrings(path)
        if length > 60 and "Longer than 60 lines:" not in doc
    ]
    assert not long, "split these functions: " + ", ".join(long)


def _functions_with_docstrings(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1, ast.get_docstring(node) or ""


def _private_names_crossing(path: Path, root: Path = ROOT) -> list[str]:
    """Where `path` uses an underscored name of another grpo module: `from grpo.x import _name`, or `x._name` on a
    grpo module it imported as `x`. Dunder names (`__version__`) are public."""
    tree, found, modules = ast.parse(path.read_text()), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo"):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            found += [f"{path.relative_to(root)}:{node.lineno} imports {node.module}.{name}" for name in private]
            modules |= {a.asname or a.name for a in node.names if not a.name[0].isupper()}
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("grpo")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            if owner in modules:
                found.append(f"{path.relative_to(root)}:{node.lineno} uses {owner}.{node.attr}")
    return found


def test_no_private_name_crosses_modules():
    """A module calls another's public names only (docs/architecture.md): an underscored name is its own module's."""
    crossing = [place for path in sorted(PACKAGE.rglob("*.py")) for place in _private_names_crossing(path)]
    assert not crossing, "private names used from another module: " + ", ".join(crossing)


def test_a_private_name_crossing_is_found(tmp_path):
    module = tmp_path / "grpo" / "user.py"
    module.parent.mkdir()
    module.write_text("from grpo.config import _hidden\nfrom grpo import models\nmodels._load()\nmodels.load()\n")
    assert _private_names_crossing(module, root=tmp_path) == [
        "grpo/user.py:1 imports grpo.config._hidden",
        "grpo/user.py:3 uses models._load",
    ]


def test_nothing_cites_a_file_outside_the_repository():
    pattern = re.compile(r"GRPO_SPEC|shared/docs|\.\./shared")
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
    ]
    cited = [
        str(f.relative_to(ROOT)) for f in files if f != Path(__file__).resolve() and pattern.search(f.read_text())
    ]
    assert not cited, f"these files cite a path outside the repository: {cited}"


def test_generation_base_imports_nothing_of_the_package():
    """The backends import base.py and the package imports the backends: base.py importing grpo would be a cycle."""
    source = (PACKAGE / "generation" / "base.py").read_text()
    assert not re.search(r"^\s*(from|import) grpo", source, flags=re.MULTILINE)


def test_one_definition_of_the_text_of_a_completion():
    """Rewards, reports and stored completions read a completion's text the same way (grpo/data/__init__.py)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, _ in _functions(path)
        if name == "completion_text"
    ]
    assert len(found) == 1, f"completion_text is defined more than once: {found}"


# The stages in the order data flows through them; a module may import its own stage and earlier ones only.
# "rollout" is grpo/rollout.py, the typed value generation makes and every later stage reads: it stands between
# data (which it is built from) and generation, so that data importing it is an arrow against the flow.
STAGES = ["data", "rollout", "generation", "rewards", "objective", "training", "cli"]
# Modules at the package root, by the stage they belong to (docs/architecture.md says why each is at the root).
ROOT_MODULES = {
    "models": "data",  # loading models: used by generation, rewards and the objective
    "errors": "data",  # InputError, importing nothing: the command line catches it without loading torch
    "rollout": "rollout",  # the typed record that crosses the stages, a stage of its own
    "testing": "data",  # tiny models for tests and examples
    "config": "training",
    "_docs": "cli",
    "__main__": "cli",
}


def _stage(module: str) -> str | None:
    """The stage of `grpo.x.y` (its folder, or ROOT_MODULES for a root module); None for the package itself and for
    grpo/contrib, which sits beside the flow (see test_contrib_is_imported_only_where_switched_on)."""
    parts = module.split(".")[1:]
    if not parts or parts[0] in ("__init__", "contrib"):
        return None
    if parts[0] in STAGES:
        return parts[0]
    return ROOT_MODULES[parts[0]]


def _imported_modules(path: Path) -> set[str]:
    """Every grpo module `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("grpo")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo"):
            found.add(node.module)
    return found


def _backward_imports(paths, root: Path) -> list[str]:
    """Every import of `paths` (files of a `grpo` package under `root`) from a stage later than the file's own."""
    backwards = []
    for path in sorted(paths):
        stage = _stage(".".join(path.relative_to(root).with_suffix("").parts))
        if stage is None:
            continue
        for imported in sorted(_imported_modules(path)):
            target = _stage(imported)
            if target is not None and STAGES.index(target) > STAGES.index(stage):
                backwards.append(f"{path.relative_to(root)} ({stage}) imports {imported} ({target})")
    return backwards


def test_imports_follow_the_data():
    """data -> rollout -> generation -> rewards -> objective -> training -> cli: no module imports a later stage,
    not one."""
    backwards = _backward_imports(PACKAGE.rglob("*.py"), ROOT)
    assert not backwards, "imports against the data flow:\n" + "\n".join(backwards)


def test_data_importing_the_rollout_is_against_the_flow(tmp_path):
    """The check above sees grpo/rollout.py as its own stage after data: a data module importing it (as
    grpo/data/offline.py did, to build a round) is reported, and the rollout importing data is not."""
    (tmp_path / "grpo" / "data").mkdir(parents=True)
    (tmp_path / "grpo" / "data" / "stored.py").write_text("from grpo.rollout import Rollout\n")
    (tmp_path / "grpo" / "rollout.py").write_text("from grpo.data import pad\nimport grpo.data.vision\n")
    found = _backward_imports((tmp_path / "grpo").rglob("*.py"), tmp_path)
    assert found == ["grpo/data/stored.py (data) imports grpo.rollout (rollout)"]


def test_every_root_module_has_a_stage():
    """A new module at the package root must be placed in ROOT_MODULES (or, better, in the folder of its stage)."""
    loose = [p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__" and p.stem not in ROOT_MODULES]
    assert not loose, f"root modules without a stage: {loose}; move them into their stage's folder"


def test_the_sandbox_harness_imports_only_the_standard_library():
    """harness.py runs inside the sandbox, whose file system holds the interpreter and its standard library only."""
    tree = ast.parse((PACKAGE / "rewards" / "sandbox" / "harness.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported and all(name.split(".")[0] in sys.stdlib_module_names for name in imported), imported


def test_importing_grpo_loads_no_sandbox():
    """The sandbox (with its seccomp filters, built through ctypes) loads when `code_execution` is built, not with
    the package or its config."""
    code = "import grpo, grpo.config, grpo.rewards, sys; print([m for m in sys.modules if 'rewards.sandbox' in m])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# ---- grpo/contrib: opt-in tuning, loaded only where a user switched it on (docs/performance.md) ----


def _imports_run_at_import(node: ast.AST):
    """The import statements a module runs when it is imported: its body's, and those of the classes, ifs and trys
    there; not those inside functions, which run only when called."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        yield from _imports_run_at_import(child)


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    module = node.module or ""
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


def test_contrib_is_imported_only_where_switched_on():
    """No module of grpo outside grpo/contrib imports grpo.contrib when it is imported: only inside the function
    that runs when a user switched a contrib option on (a compiled kernel, process-wide malloc settings)."""
    eager = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "contrib" not in path.relative_to(PACKAGE).parts
        for node in _imports_run_at_import(ast.parse(path.read_text()))
        if any(name == "grpo.contrib" or name.startswith("grpo.contrib.") for name in _names(node))
    ]
    assert not eager, "grpo.contrib imported at module level (import it inside the switched-on path): " + ", ".join(
        eager
    )


def test_a_default_trainer_loads_no_contrib_module():
    """`GRPOTrainer` with the default config, and a round of sampling with its sampler, load no grpo.contrib module:
    no compiled kernel, no ctypes of grpo's, no mallopt (use_cpu: the CPU path, where they would apply)."""
    code = """
import sys, tempfile
from datasets import Dataset
from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer
tokenizer = tiny_tokenizer()
args = GRPOConfig(
    output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True,
    num_generations=2, per_device_train_batch_size=2, max_completion_length=4,
)
trainer = GRPOTrainer(
    tiny_model(tokenizer), lambda completions, **kw: [0.0] * len(completions), args=args,
    train_dataset=Dataset.from_dict({"prompt": ["one", "two"]}), processing_class=tokenizer,
)
trainer.generation.generate(trainer.model, [[5, 6, 7], [5, 6, 7]])
print([m for m in sys.modules if m == "grpo.contrib" or m.startswith("grpo.contrib.")])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out
