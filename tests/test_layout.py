"""The shape docs/architecture.md promises: a trainer that only sequences, short functions, no citations of files
outside the repository, and one definition of the text of a completion."""

import ast
import re
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
