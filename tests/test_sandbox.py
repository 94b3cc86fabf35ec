"""Untrusted code in `code_execution`: each attack must score 0 (or `on_error`) and leave the trainer's process,
files, environment and network untouched. Limits are shrunk (1 s CPU, 2 s wall, 256 MB) to keep each test under
a couple of seconds."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from grpo.rewards import code_execution
from grpo.sandbox import Limits, run_python

LIMITS = dict(wall_seconds=2.0, cpu_seconds=1, memory_mb=256)
PASSES = ["assert True"]  # a test any completion that runs to the end passes


def score(code, tests=PASSES, **options):
    return code_execution(**{**LIMITS, **options})([code], tests=[tests])[0]


def test_correct_code_passes_and_may_use_the_standard_library_and_its_directory():
    code = """
import collections, json, math, re
from dataclasses import dataclass

@dataclass
class Box:
    n: int

def solve(xs):
    with open("scratch.json", "w") as f:  # inside its own working directory: allowed
        json.dump(xs, f)
    with open("scratch.json") as f:
        return sum(collections.Counter(json.load(f)).values()) + math.floor(0.5) + Box(0).n
"""
    assert score(code, ["assert solve([1, 2, 2]) == 3", "assert solve([]) == 0", "assert solve([1]) == 5"]) == 2 / 3


def test_infinite_loop_is_stopped():
    began = time.perf_counter()
    assert score("while True:\n    pass") == 0.0
    assert time.perf_counter() - began < 5


def test_sleeping_forever_hits_the_wall_clock_limit():
    began = time.perf_counter()
    result = run_python("import time\ntime.sleep(60)", PASSES, Limits(wall_seconds=1.0))
    assert result.passed == 0 and "timed out after 1.0 s" in result.error
    assert time.perf_counter() - began < 4


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])",
        "import os\nos.system('sleep 30 &')",
        "import multiprocessing\nmultiprocessing.Process(target=print).start()",
        "import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 30'])",
    ],
    ids=["fork", "subprocess", "system", "multiprocessing", "exec"],
)
def test_no_new_processes(code):
    assert score(code) == 0.0


def test_unbounded_allocation_fails_inside_the_child():
    assert score("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))") == 0.0
    assert score("x = bytearray(64 * 1024**3)") == 0.0


def test_files_outside_the_working_directory_are_out_of_reach(tmp_path):
    secret, keep, escape = tmp_path / "secret.txt", tmp_path / "keep.txt", tmp_path / "escape.txt"
    secret.write_text("s3cret")
    keep.write_text("keep me")
    read = f"data = open({str(secret)!r}).read()"
    assert score(read, ["assert data == 's3cret'"]) == 0.0
    assert score(f"open({str(escape)!r}, 'w').write('x')") == 0.0
    assert score(f"import os\nos.remove({str(keep)!r})") == 0.0
    assert score(f"import shutil\nshutil.rmtree({str(tmp_path)!r})") == 0.0
    assert score(f"import os\nos.symlink({str(keep)!r}, 'link')\nopen('link', 'w').write('x')") == 0.0
    assert score(f"import os\nfiles = os.listdir({str(tmp_path)!r})") == 0.0
    assert score(f"import os\nos.chdir({str(tmp_path)!r})\nopen('escape.txt', 'w').write('x')") == 0.0
    deep = "import os\nos.makedirs('a/b')\nfd = os.open('a/b', os.O_RDONLY)\n"
    assert score(deep + f"os.open('../../../..{str(escape)}', os.O_WRONLY | os.O_CREAT, dir_fd=fd)") == 0.0
    assert not escape.exists() and keep.read_text() == "keep me"


def test_the_trainers_environment_variables_are_invisible(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    assert score("import os", ["assert os.environ.get('GRPO_TEST_SECRET') == 'hunter2'"]) == 0.0
    assert score("import os", ["assert 'GRPO_TEST_SECRET' not in os.environ"]) == 1.0  # the check itself works


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        assert score(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)") == 0.0
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()


def test_other_processes_cannot_be_signalled():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert score(f"import os, signal\nos.kill({victim.pid}, signal.SIGKILL)") == 0.0
        assert score(f"import os\nos.killpg(os.getpgid({victim.pid}), 9)") == 0.0
        time.sleep(0.1)
        assert victim.poll() is None  # still running
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_exiting_early_or_printing_a_fake_result_does_not_pass():
    assert score("import os\nos._exit(0)") == 0.0
    assert score("import sys\nprint('1 passed')\nsys.exit(0)") == 0.0
    # A well-formed result line on the report descriptor, without the random token, then a quick exit.
    forged = "import os\nos.write(3, b'0' * 32 + b' {\"passed\": 1, \"error\": null}\\n')\nos._exit(0)"
    assert score(forged) == 0.0


def test_failures_can_give_none_instead_of_zero():
    assert score("raise RuntimeError('boom')", on_error=None) is None
    assert score("x = 1", ["assert x == 2"], on_error=None) == 0.0  # ran fine, failed its test: a real 0
    assert code_execution(**LIMITS)(["x = 1", "x = 1"], tests=[None, []]) == [None, None]


def test_working_directory_is_removed_afterwards():
    marker = f"grpo-sandbox-probe-{os.getpid()}"
    assert score(f"import os\nopen({marker!r}, 'w').write('x')\nprint(os.getcwd())") == 1.0
    import tempfile

    leftovers = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("grpo-sandbox-")]
    assert not any(os.path.exists(os.path.join(tempfile.gettempdir(), d, marker)) for d in leftovers)
