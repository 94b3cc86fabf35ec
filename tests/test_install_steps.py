"""The installs print one line per step and pip's output only when a step fails (scripts/step.sh, the Makefile)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "scripts" / "step.sh"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="scripts/step.sh is a bash script")


def step(*command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(STEP), *command], capture_output=True, text=True, env=env)


@needs_bash
def test_a_step_that_succeeds_is_one_line_without_its_output(tmp_path):
    done = step("installing something", "sh", "-c", "echo pip says a lot; echo and more >&2", tmp_path=tmp_path)
    assert done.returncode == 0
    assert re.fullmatch(r"installing something \.\.\. done \(\d+ s\)\n", done.stdout), done.stdout
    assert done.stderr == "" and list(tmp_path.iterdir()) == []  # the log is gone


@needs_bash
def test_a_step_that_fails_shows_the_tail_of_its_output_and_its_status(tmp_path):
    script = "for i in $(seq 1 100); do echo line $i; done; echo the error >&2; exit 3"
    failed = step("installing something", "sh", "-c", script, tmp_path=tmp_path)
    assert failed.returncode == 3
    lines = failed.stdout.splitlines()
    assert re.fullmatch(r"installing something \.\.\. failed \(exit status 3, after \d+ s\).*", lines[0])
    assert lines[1:41] == [f"line {i}" for i in range(62, 101)] + ["the error"]  # the last 40 lines
    (log,) = tmp_path.iterdir()  # kept, and named
    assert lines[-1] == f"(all of it: {log})" and log.read_text().count("\n") == 101


@needs_bash
def test_step_without_a_command_is_a_usage_error(tmp_path):
    assert step("only a label", tmp_path=tmp_path).returncode == 2


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_every_pip_run_of_the_installs_goes_through_a_step():
    # make -n prints the recipes without running them; -B as if nothing were installed yet.
    targets = ["install", "install-vllm", "install-trl", "docs"]
    planned = subprocess.run(["make", "-n", "-B", *targets], cwd=ROOT, capture_output=True, text=True, check=True)
    commands = planned.stdout.replace("\\\n", " ").splitlines()
    pip = [c for c in commands if " pip " in c]
    assert len(pip) >= 15, planned.stdout
    bare = [c for c in pip if "scripts/step.sh" not in c]
    assert bare == [], bare
    # torch and grpo in one shell line: both see the same constraints-cpu.txt pin, computed once.
    (torch_line,) = [c for c in commands if "install -q $pin torch" in c]
    assert '-e ".[dev,peft]"' in torch_line
