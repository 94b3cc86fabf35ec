"""`grpo --help`, `grpo --version` and the usage errors answer without importing torch and the libraries built on it
(issue 52: they took about 30 s on a loaded machine, most of it importing torch, transformers and peft). Measured
by the modules a fresh `python -m grpo` process holds when it exits, not by seconds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate")
# Runs `grpo.cli.main` as `python -m grpo` does, then prints which of HEAVY were imported, on a line of its own.
PROBE = """
import sys
import runpy
sys.argv = ["grpo", *sys.argv[1:]]
try:
    runpy.run_module("grpo", run_name="__main__")
except SystemExit as done:
    code = done.code
else:
    code = 0
print("imported:", [m for m in {heavy!r} if m in sys.modules])
sys.exit(code)
"""


def run_probe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = PROBE.format(heavy=HEAVY)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["--help"], 0, "usage: grpo"),
        (["--version"], 0, "grpo "),
        ([], 2, "the following arguments are required: COMMAND"),
        (["trian"], 2, "invalid choice: 'trian'"),
        (["plot"], 2, "the following arguments are required: output_dir"),
        (["train"], 2, "Name a recipe: grpo train RECIPE.yaml"),
        (["check"], 2, "Name a recipe: grpo check RECIPE.yaml"),
        (["env", "extra"], 2, "unrecognized arguments: extra"),
    ],
    ids=["help", "version", "no command", "unknown command", "plot without a folder", "train", "check", "extra"],
)
def test_answers_without_torch(tmp_path, args, status, says):
    result = run_probe(args, tmp_path)
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert says in result.stdout + result.stderr
    assert "imported: []" in result.stdout, result.stdout


def test_the_probe_sees_a_heavy_import(tmp_path):
    """The probe can fail: `grpo env` reports torch's version, so it imports torch, and the probe says so."""
    result = run_probe(["env"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "'torch'" in result.stdout.splitlines()[-1]


def test_grpo_config_is_still_importable_from_the_package():
    """GRPOConfig is read lazily, like the other public names, and is the same class as grpo.config's."""
    import grpo
    from grpo import GRPOConfig
    from grpo.config import GRPOConfig as Config

    assert GRPOConfig is Config and "GRPOConfig" in dir(grpo) and "GRPOConfig" in grpo.__all__
