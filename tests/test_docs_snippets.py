"""Every ```python and ```bash block of docs/*.md and README.md, run, so that a renamed argument breaks this test and
not a reader's copy of it (docs/contributing.md, "Snippets", describes the markers).

- Python blocks of one page run in order in one namespace, like the cells of a notebook, in a temporary working
  directory. A block may be preceded by an HTML comment that the site does not show:
  `<!-- snippet: setup ... -->` (Python run first in the same namespace: the tiny model behind a hub id, a data
  set the prose only describes), `<!-- snippet: skip (reason) -->`, `<!-- snippet: slow (reason) -->` or
  `<!-- snippet: gpu (reason) -->` (the pytest markers of the same names).
- Shell blocks run with bash in the repository root, with this interpreter's bin/ first on PATH, unless marked
  skip. Whatever the marker, every `grpo train RECIPE [--key value ...]` command in a shell block is parsed and
  validated as `grpo train` does before it loads anything, so a renamed recipe key or field fails even in a
  command too expensive to run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SHELL = ("bash", "sh", "shell")
MARKER = re.compile(r"<!--\s*snippet:\s*(\w+)(.*?)-->", re.S)
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "python" or "bash"
    code: str
    setup: str = ""  # hidden Python run before it
    mark: str = ""  # "", "skip", "slow" or "gpu"
    reason: str = ""
    markers: int = 0  # HTML comments attached to it

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def extract(page: Path) -> list[Snippet]:
    """The python and shell blocks of `page`, each with the markers in the HTML comments right above its fence."""
    text = page.read_text()
    lines = text.splitlines()
    snippets, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if lang == "python" or lang in SHELL:
            code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
            snippet = Snippet(page, i + 1, "python" if lang == "python" else "bash", code)
            # The comments that end on the line above the fence (skipping blank lines), nearest last.
            above = "\n".join(lines[:i]).rstrip()
            while above.endswith("-->"):
                start = above.rfind("<!--")
                marker = MARKER.fullmatch(above[start:])
                if marker is None:
                    break
                kind, rest = marker.group(1), marker.group(2)
                snippet.markers += 1
                if kind == "setup":
                    snippet.setup = rest.strip("\n") + "\n" + snippet.setup
                elif kind in ("skip", "slow", "gpu"):
                    snippet.mark, snippet.reason = kind, rest.strip().strip("()")
                    assert kind != "skip" or snippet.reason, f"{snippet.id}: a skip marker needs a (reason)"
                else:
                    raise AssertionError(f"{snippet.id}: unknown snippet marker {kind!r}")
                above = above[:start].rstrip()
            snippets.append(snippet)
        i = end + 1
    return snippets


SNIPPETS = [s for page in PAGES for s in extract(page)]


def _param(snippet: Snippet):
    first = next(s for s in SNIPPETS if (s.code, s.setup) == (snippet.code, snippet.setup))
    if first is not snippet and snippet.mark != "skip":  # README.md repeats docs/index.md's example
        return pytest.param(
            snippet, id=snippet.id, marks=[pytest.mark.skip(reason=f"the same code runs as {first.id}")]
        )
    marks = {
        "skip": [pytest.mark.skip(reason=snippet.reason)],
        "slow": [pytest.mark.slow],
        "gpu": [pytest.mark.gpu],
        "": [],
    }[snippet.mark]
    return pytest.param(snippet, id=snippet.id, marks=marks)


# ---- Python ----

# Per page: the namespace and how many of its python blocks have run in it. Tests run in file order, so each block
# normally finds the one before it done; run alone (-k), a block first replays the earlier blocks of its page.
_pages: dict[Path, tuple[dict, int]] = {}
_failed: set[str] = set()  # blocks whose own test failed: the page's later blocks skip instead of failing again


def _run_python(snippet: Snippet, namespace: dict) -> None:
    for part, code in (("setup", snippet.setup), ("block", snippet.code)):
        if code.strip():
            exec(compile(code, f"{snippet.id} ({part})", "exec"), namespace)


@pytest.mark.parametrize("snippet", [_param(s) for s in SNIPPETS if s.lang == "python"])
def test_python_snippet(snippet: Snippet, tmp_path_factory, monkeypatch):
    page_blocks = [s for s in SNIPPETS if s.page == snippet.page and s.lang == "python"]
    index = page_blocks.index(snippet)
    namespace, done = _pages.get(snippet.page, ({}, 0))
    if done != index:  # replay the page's earlier blocks (those not marked skip) into a fresh namespace
        namespace = {"__workdir__": tmp_path_factory.mktemp(snippet.page.stem)}
        monkeypatch.chdir(namespace["__workdir__"])
        for earlier in page_blocks[:index]:
            if earlier.id in _failed:
                pytest.skip(f"needs {earlier.id}, which failed")
            if earlier.mark != "skip":
                _run_python(earlier, namespace)
    namespace.setdefault("__workdir__", tmp_path_factory.mktemp(snippet.page.stem))
    namespace.setdefault("__name__", f"snippet_{snippet.page.stem}")
    monkeypatch.chdir(namespace["__workdir__"])
    _failed.add(snippet.id)
    _run_python(snippet, namespace)
    _failed.discard(snippet.id)
    _pages[snippet.page] = (namespace, index + 1)


# ---- Shell ----


def _commands(code: str) -> list[list[str]]:
    """The shell block's simple commands as argument lists: continuation lines joined, comments dropped, split at
    `;`, `&&`, `||`, `|` and `&` (outside quotes)."""
    commands = []
    for line in re.sub(r"\\\n", " ", code).splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token and set(token) <= set(";&|"):
                commands += [words] if words else []
                words = []
            else:
                words.append(token)
    return commands


def grpo_train_calls(code: str) -> list[tuple[str, list[str]]]:
    """(recipe, overrides) of every `grpo train ...` or `... -m grpo train ...` command in a shell block."""
    calls = []
    for words in _commands(code):
        for i in range(len(words) - 2):
            if words[i].endswith("grpo") and words[i + 1] == "train" and not words[i + 2].startswith("-"):
                calls.append((words[i + 2], words[i + 3 :]))
                break
    return calls


@pytest.mark.parametrize(
    "snippet", [pytest.param(s, id=s.id) for s in SNIPPETS if s.lang == "bash" and grpo_train_calls(s.code)]
)
def test_grpo_train_commands_are_valid(snippet: Snippet, monkeypatch):
    # What `grpo train` checks before it loads a model: the recipe, each override's key and value, GRPOConfig.
    from grpo.cli.recipe import load_recipe

    monkeypatch.chdir(ROOT)
    for recipe, overrides in grpo_train_calls(snippet.code):
        if not (ROOT / recipe).exists():
            assert snippet.mark == "skip", (
                f"{snippet.id}: {recipe} does not exist (a placeholder? mark the block skip)"
            )
            continue
        if not torch.cuda.is_available():  # the GPU recipes ask for bf16, which TrainingArguments refuses on a CPU
            overrides = [*overrides, "--bf16", "false"]
        try:
            load_recipe(recipe, overrides).grpo_config()
        except Exception as e:
            raise AssertionError(f"{snippet.id}: `grpo train {recipe} {' '.join(overrides)}` fails: {e}") from e


@pytest.mark.parametrize("snippet", [_param(s) for s in SNIPPETS if s.lang == "bash"])
def test_shell_snippet(snippet: Snippet):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", snippet.code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{snippet.id} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"


def test_markers_are_found():
    # A marker the extractor misses would run (or skip) a block silently; every marker in the docs must attach.
    for page in PAGES:
        written = len(re.findall(r"^\s*<!--\s*snippet:", page.read_text(), re.M))  # not those quoted in `code`
        attached = sum(s.markers for s in extract(page))
        assert attached == written, f"{page.name}: a snippet marker is not directly above a python or shell fence"
