"""Sandboxed code never outlives what started it (issue 53): not a caller killed with SIGKILL, not its own wall
limit while the caller does nothing, not a tool or reward call that timed out, not `train()`.

Each sandbox of a test is found by a marker of its own: a comment line with a fresh random token put at the top of
the harness's source (`sandbox.HARNESS`), which every sandbox process carries in its command line (bwrap, the
supervisor and the worker it forks); only this user's processes are read. Limits are short (a 2 s wall) where the
test waits for them; where the test must show that something else ended the sandbox first, the wall limit is long
(30 s), which costs nothing when the sandbox is killed in time. Tests under bubblewrap skip where it cannot run,
as in tests/test_sandbox.py (CI requires it there).
"""

import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest

import grpo.rewards.sandbox as sandbox
from grpo import GRPOTrainer
from grpo.rewards import code_execution, python_tool
from grpo.rewards.runner import check_rewards, run_reward_functions
from grpo.rewards.sandbox import Limits, SandboxUnavailable, harness, run_python
from grpo.testing import save_tiny_model
from tests.helpers.agents import ScriptedTurns, call, chat_prompts, tool_tokenizer
from tests.test_agents import config

ROOT = Path(__file__).resolve().parents[1]
SLEEPS = "import time\ntime.sleep(60)"
ISOLATION = pytest.mark.parametrize("isolation", ["bwrap", "process"])
# The processes of one sandbox once its code runs: bwrap, the supervisor (pid 1 of bwrap's PID namespace) and the
# worker; without bubblewrap, the supervisor and the worker.
PROCESSES = {"bwrap": 3, "process": 2}

# A caller of the sandbox in a process of its own, to be killed or stopped. It loads grpo.rewards.sandbox without
# the package's __init__ files (they import transformers: seconds of start-up on a busy machine); the sandbox needs
# only the standard library and grpo/generation/call_scope.py.
CALLER = """
import os, sys, types
root, isolation, wall = sys.argv[1:4]
for name in ("grpo", "grpo.generation", "grpo.rewards"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = package
import grpo.rewards.sandbox as sandbox
sandbox.check_isolation(isolation)  # before the marker: bwrap's check starts a sandbox of its own, which ends at once
sandbox.HARNESS = "# " + os.environ["SANDBOX_MARKER"] + "\\n" + sandbox.HARNESS
sandbox.run_python("import time\\ntime.sleep(60)", [], sandbox.Limits(wall_seconds=float(wall)), isolation=isolation)
"""


def usable(isolation: str) -> None:
    """Skip where this isolation cannot run here (bubblewrap missing, or no user namespaces)."""
    try:
        sandbox.check_isolation(isolation)
    except SandboxUnavailable as e:
        pytest.skip(str(e))


def real_uid(pid: str) -> int | None:
    with open(f"/proc/{pid}/status") as f:  # /proc/PID itself is root's for a process that is not dumpable
        for line in f:
            if line.startswith("Uid:"):
                return int(line.split()[1])
    return None


def marked(marker: str) -> list[int]:
    """This user's processes whose command line holds `marker` (a zombie's is empty: it is not counted)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if real_uid(pid) != os.getuid():
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # gone meanwhile
            pass
    return found


def wait_until(condition, seconds: float) -> bool:
    """Poll `condition` until it holds or `seconds` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def marker(monkeypatch):
    """A fresh marker, put into this process's sandboxes too; any marked process left is killed afterwards (by pid:
    they are this test's own)."""
    token = f"grpo-lifetime-test-{uuid.uuid4().hex}"
    monkeypatch.setattr(sandbox, "HARNESS", f"# {token}\n" + sandbox.HARNESS)
    yield token
    for pid in marked(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def start_caller(marker: str, isolation: str, wall: float) -> subprocess.Popen:
    """A process running one sandbox of `marker` whose code sleeps; returns once that code runs."""
    env = {**os.environ, "SANDBOX_MARKER": marker}
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(ROOT), isolation, str(wall)], env=env)
    if not wait_until(lambda: len(marked(marker)) >= PROCESSES[isolation] or caller.poll() is not None, 60):
        caller.kill()
        pytest.fail("the caller's sandbox did not start within 60 s")
    assert caller.poll() is None, f"the caller exited ({caller.returncode}) before its sandbox was seen"
    return caller


@ISOLATION
def test_a_caller_killed_with_sigkill_leaves_no_sandbox_process(isolation, marker):
    # The out-of-memory killer, or a cluster's hard kill: nothing runs in the caller to clean up. Under "process"
    # the supervisor and the worker used to live on as orphans past their wall limit (30 s here), indefinitely.
    usable(isolation)
    caller = start_caller(marker, isolation, wall=30)
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    assert wait_until(lambda: not marked(marker), 2), f"sandbox processes outlived their caller: {marked(marker)}"


@ISOLATION
def test_a_sandbox_past_its_wall_limit_ends_without_its_callers_help(isolation, marker):
    # The caller is stopped (SIGSTOP): it can neither time the run out nor kill anything. The supervisor's own timer
    # ends the sandbox at its wall limit; the processes were seen after the run began, so its limit has passed a
    # second after `seen + wall`.
    usable(isolation)
    wall = 2.0
    caller = start_caller(marker, isolation, wall=wall)
    seen = time.monotonic()
    os.kill(caller.pid, signal.SIGSTOP)
    try:
        gone = wait_until(lambda: not marked(marker), seen + wall + 1.0 - time.monotonic())
        assert gone, f"sandbox processes ran past their wall limit of {wall} s: {marked(marker)}"
    finally:
        caller.kill()
        os.kill(caller.pid, signal.SIGCONT)
        caller.wait()


@ISOLATION
def test_a_timed_out_python_tool_leaves_no_sandbox_after_train(isolation, marker, tmp_path):
    # The call is answered "took longer than 1.0 s" at tool_timeout; its sandbox, with 30 s of wall time left, used
    # to run on after train() returned. Building the trainer warns about the mismatch, naming both values.
    usable(isolation)
    path = tmp_path / "model"
    save_tiny_model(path)
    tokenizer = tool_tokenizer()
    seen = {}

    def answered(prompts, completions, **kwargs):
        seen["answer"] = completions[0][1]["content"]
        return [0.0] * len(completions)

    python = python_tool(Limits(wall_seconds=30.0, cpu_seconds=30, memory_mb=256), isolation=isolation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(
            str(path),
            answered,
            args=config(tmp_path, tool_timeout=1.0, max_completion_length=500),
            train_dataset=chat_prompts(2),
            processing_class=tokenizer,
            tools=[python],
        )
    trainer.generation = ScriptedTurns(tokenizer, [[call("python", code=SLEEPS), "Done."]])
    trainer.train()
    assert seen["answer"] == "Error: the call of 'python' took longer than 1.0 s"
    # SIGKILL was sent when the call timed out; the kernel takes a moment to end a PID namespace.
    assert wait_until(lambda: not marked(marker), 1), f"sandbox processes outlived train(): {marked(marker)}"
    mismatch = [str(w.message) for w in caught if "tool_timeout" in str(w.message)]
    assert len(mismatch) == 1 and "'python' runs code for up to 30.0 s" in mismatch[0], mismatch
    assert "tool_timeout=1.0 s ends each call" in mismatch[0] and "tool_timeout=35" in mismatch[0]


@ISOLATION
def test_a_timed_out_reward_call_kills_its_sandboxes_and_starts_no_more(isolation, marker):
    # reward_timeout=1 s on code_execution: one row's code sleeps, so the call times out; its running sandbox is
    # killed and the rows after it (max_parallel=1) never start a sandbox.
    usable(isolation)
    reward = code_execution(wall_seconds=30.0, cpu_seconds=30, memory_mb=256, max_parallel=1, isolation=isolation)
    rows = [SLEEPS, "x = 1", "x = 2"]
    cases = [[{"call": "1", "expected": 1}]] * 3
    available = {"prompts": ["p"] * 3, "completions": rows, "cases": cases}
    values, failed = run_reward_functions([reward], [check_rewards], available, errors="skip", timeout=1.0)
    assert values == [[None, None, None]] and failed == [3]
    assert wait_until(lambda: not marked(marker), 1), f"sandbox processes outlived the reward call: {marked(marker)}"
    time.sleep(0.5)  # the abandoned call's thread goes on to the next rows, which must not start a sandbox
    assert not marked(marker)


def test_a_supervisor_whose_parent_is_already_gone_exits_at_once():
    # The race the parent-death signal leaves open: a parent that ended before the signal was set sent none. The
    # supervisor compares getppid() with the parent it was given (here pid 1, which is not its parent) and exits
    # before it reads the job (stdin stays open: the old harness waited on it).
    deadline = time.monotonic() + 30
    argv = [sys.executable, "-I", "-S", "-B", "-c", sandbox.HARNESS, "grpo-sandbox", "1", repr(deadline), "30"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.stdin.close()
        proc.wait()
    assert proc.returncode == harness.PARENT_GONE


def test_an_abandoned_call_starts_no_sandbox_and_stops_what_it_registered():
    from grpo.generation.call_scope import CallScope

    scope = CallScope()
    stopped = []
    assert scope.enter(lambda: stopped.append("first"))
    scope.abandon()
    assert stopped == ["first"] and scope.abandoned
    assert not scope.enter(lambda: stopped.append("late"))  # refused: the caller stops it itself
    result = scope.run(run_python, "print(1)", [], Limits(wall_seconds=2.0), isolation="process")
    assert result.output == "" and "abandoned at its timeout" in result.error


def test_the_sandbox_refuses_to_run_where_it_cannot_die_with_its_parent(monkeypatch):
    monkeypatch.setattr(sandbox.sys, "platform", "darwin")
    for isolation in ("bwrap", "process"):
        with pytest.raises(SandboxUnavailable, match="Linux only .* PR_SET_PDEATHSIG"):
            sandbox.check_isolation(isolation)
