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
    lines = len((PACKAGE / "trainer.py").read_text().splitlines())
    assert lines <= 500, f"grpo/trainer.py has {lines} lines; move logic into the module of its stage"


def test_no_function_is_longer_than_80_lines():
    long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, length in _functions(path)
        if length > 80
    ]
    assert not long, "split these functions: " + ", ".join(long)


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


def test_the_rewards_stage_imports_no_later_stage():
    """Imports follow the data (data -> generation -> rewards -> objective -> training): no module of grpo/rewards
    imports the objective, the trainer or the command line."""
    later = re.compile(
        r"^\s*(from|import) grpo\.(objective|trainer|cli|async_rounds|dynamic_sampling)\b", re.MULTILINE
    )
    found = [
        str(p.relative_to(ROOT)) for p in sorted((PACKAGE / "rewards").rglob("*.py")) if later.search(p.read_text())
    ]
    assert not found, f"these reward modules import a later stage: {found}"


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
