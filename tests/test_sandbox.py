"""Untrusted code in `code_execution`: each attack must score 0 (or `on_error`) and leave the trainer's process,
files, environment and network untouched. Limits are shrunk (1 s CPU, 2 s wall, 256 MB) to keep each test under
a couple of seconds.

The attack tests run every attack twice: with the audit hook (the full sandbox) and without it (`audit_hook=False`),
which shows that the operating-system layers (bubblewrap's namespaces, the read-only mounts, seccomp, rlimits)
hold on their own. They need bubblewrap and skip without it, except under CI, where its absence fails
`test_ci_runs_the_bubblewrap_tier`.
"""

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

import grpo.rewards.sandbox as sandbox
from grpo.rewards import code_execution
from grpo.rewards.sandbox import Limits, SandboxUnavailable, run_cases, run_python
from grpo.rewards.sandbox.cases import check_cases, judge, same, same_output

LIMITS = dict(wall_seconds=2.0, cpu_seconds=1, memory_mb=256)
PASSES = ["assert True"]  # a test any completion that runs to the end passes
HAS_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAS_BWRAP, reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
)
HOOK = pytest.mark.parametrize("hook", [True, False], ids=["with-hook", "os-layers-only"])
# Most tests here score by `tests` on purpose (the attacks predate cases); the warning that recommends cases for
# training is checked once, in test_code_execution_reads_cases_or_tests_and_warns_about_tests.
pytestmark = pytest.mark.filterwarnings("ignore:code_execution scores rows by their `tests`:UserWarning")


def score(code, tests=PASSES, **options):
    return code_execution(**{**LIMITS, **options})([code], tests=[tests])[0]


def attack_all(codes, hook, tests=PASSES, cases=None, **limits):
    """Run each attack in its own sandbox, all at once, against `tests` (or `cases`, when given); return the results
    and each run's wall time."""

    def one(code):
        began = time.perf_counter()
        if cases is not None:
            result = run_cases(code, cases, Limits(**{**LIMITS, **limits}), audit_hook=hook)
        else:
            result = run_python(code, tests, Limits(**{**LIMITS, **limits}), audit_hook=hook)
        return result, time.perf_counter() - began

    with ThreadPoolExecutor(len(codes)) as pool:
        return list(pool.map(one, codes))


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process on the machine (from /proc/PID/stat, whose 4th field is the parent)."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                # The command name (2nd field) is in parentheses and may hold spaces: read after its last ')'.
                parents[int(pid)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return parents


def sandbox_processes() -> list[int]:
    """This test process's descendants still running the sandbox's harness (none may outlive `run_python`); zombies
    are ignored. Only descendants count: another test run on the same machine has harness processes of its own.
    `bystanders` makes this process a child subreaper, so a harness process that double-forks away from its parent
    is reparented here, not to init, and is still counted."""
    parents, me, left = _parents(), os.getpid(), []
    for pid in parents:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"def supervise" not in f.read():
                    continue
        except OSError:
            continue
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, me):
            ancestor = parents.get(ancestor)
        if ancestor == me:
            left.append(pid)
    return left


def become_subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER, 1): orphaned descendants are reparented to this process (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # 36: PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@pytest.fixture
def bystanders(tmp_path):
    """A process and a file of the trainer's that no attack may touch; checked after the test."""
    become_subreaper()  # a sandbox process that escapes its parent stays our descendant, so `sandbox_processes` sees it
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    keep = tmp_path / "keep.txt"
    keep.write_text("keep me")
    yield victim, keep
    alive = victim.poll() is None
    victim.kill()
    victim.wait()
    assert alive, "an outside process was killed"
    assert keep.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    deadline = time.monotonic() + 2  # the kernel tears a PID namespace down asynchronously
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sandbox_processes(), "sandbox processes outlived run_python"


# ---- the sandbox's ordinary behaviour (the default isolation, bubblewrap) ----


@needs_bwrap
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


@needs_bwrap
def test_infinite_loop_is_stopped():
    began = time.perf_counter()
    assert score("while True:\n    pass") == 0.0
    assert time.perf_counter() - began < 5


@needs_bwrap
def test_sleeping_forever_hits_the_wall_clock_limit():
    began = time.perf_counter()
    result = run_python("import time\ntime.sleep(60)", PASSES, Limits(wall_seconds=1.0))
    assert result.passed == 0 and "timed out after 1.0 s" in result.error
    assert time.perf_counter() - began < 4


@needs_bwrap
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


@needs_bwrap
def test_unbounded_allocation_fails_inside_the_child():
    assert score("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))") == 0.0
    assert score("x = bytearray(64 * 1024**3)") == 0.0


@needs_bwrap
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


@needs_bwrap
def test_the_trainers_environment_variables_are_invisible(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    assert score("import os", ["assert os.environ.get('GRPO_TEST_SECRET') == 'hunter2'"]) == 0.0
    assert score("import os", ["assert 'GRPO_TEST_SECRET' not in os.environ"]) == 1.0  # the check itself works


@needs_bwrap
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


@needs_bwrap
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


@needs_bwrap
def test_exiting_early_or_printing_a_fake_result_does_not_pass():
    assert score("import os\nos._exit(0)") == 0.0
    assert score("import sys\nprint('1 passed')\nsys.exit(0)") == 0.0
    # A well-formed result line on the report descriptor, without the random token, then a quick exit.
    forged = "import os\nos.write(3, b'0' * 32 + b' {\"passed\": 1, \"error\": null}\\n')\nos._exit(0)"
    assert score(forged) == 0.0


@needs_bwrap
def test_failures_can_give_none_instead_of_zero():
    assert score("raise RuntimeError('boom')", on_error=None) is None
    assert score("x = 1", ["assert x == 2"], on_error=None) == 0.0  # ran fine, failed its test: a real 0
    assert code_execution(**LIMITS)(["x = 1", "x = 1"], tests=[None, []]) == [None, None]


@needs_bwrap
def test_working_directory_is_removed_afterwards():
    marker = f"grpo-sandbox-probe-{os.getpid()}"
    assert score(f"import os\nopen({marker!r}, 'w').write('x')\nprint(os.getcwd())") == 1.0
    import tempfile

    leftovers = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("grpo-sandbox-")]
    assert not any(os.path.exists(os.path.join(tempfile.gettempdir(), d, marker)) for d in leftovers)


# ---- one test per attack class, with and without the audit hook ----


@needs_bwrap
@HOOK
def test_attack_signals_to_outside_processes(hook, bystanders):
    victim, _ = bystanders
    me, group = os.getpid(), os.getpgid(0)
    libc = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    check = "if {call} != 0:\n    raise OSError(ctypes.get_errno(), 'refused')\n"
    codes = [
        f"import os\nos.kill({victim.pid}, 9)",
        f"import os\nos.kill({me}, 9)",
        f"import os\nos.killpg({group}, 9)",
        f"import os\nos.killpg({victim.pid}, 9)",
        "import os\nos.kill(-1, 9)",
        f"import signal\nsignal.pthread_kill({victim.pid}, 9)",
        libc + check.format(call=f"libc.kill({victim.pid}, 9)") + check.format(call=f"libc.kill({me}, 9)"),
        libc + check.format(call="libc.kill(-1, 9)"),
        libc + f"for pid in ({victim.pid}, {me}):\n"
        "    fd = libc.syscall(434, pid, 0)  # pidfd_open\n"
        "    if fd < 0 or libc.syscall(424, fd, 9, None, 0) != 0:  # pidfd_send_signal\n"
        "        raise OSError(ctypes.get_errno(), 'refused')\n",
        "import subprocess\nsubprocess.run(['kill', '-9', '-1'], check=True)",
        "import subprocess\nsubprocess.run(['sh', '-c', 'kill -9 -1'], check=True)",
        "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import os; os.kill(-1, 9)'])\nraise SystemExit",
    ]
    for code, (result, _) in zip(codes, attack_all(codes, hook)):
        assert result.passed == 0, code
    time.sleep(0.1)  # a signal, had one been sent, has landed


@needs_bwrap
@HOOK
def test_attack_files_outside_the_working_directory(hook, bystanders, tmp_path):
    _, keep = bystanders
    new = tmp_path / "created.txt"
    stdlib_probe = os.path.join(sysconfig.get_paths()["stdlib"], f"grpo_sandbox_probe_{os.getpid()}.txt")
    flags = ["O_WRONLY | os.O_TRUNC", "O_WRONLY | os.O_APPEND", "O_WRONLY", "O_RDWR | os.O_CREAT | os.O_TRUNC"]
    codes = [f"import os\nos.write(os.open({str(keep)!r}, os.{f}), b'pwned')" for f in flags]
    codes += [f"import os\nos.write(os.open({str(p)!r}, os.O_WRONLY | os.O_CREAT), b'x')" for p in (new, stdlib_probe)]
    libc = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    for path, flag in [
        (keep, os.O_WRONLY | os.O_TRUNC),
        (keep, os.O_WRONLY | os.O_APPEND),
        (new, os.O_WRONLY | os.O_CREAT),
    ]:
        codes.append(
            libc + f"fd = libc.open({str(path).encode()!r}, {flag}, 0o644)\n"
            "if fd < 0 or libc.write(fd, b'pwned', 5) != 5:\n    raise OSError(ctypes.get_errno(), 'refused')"
        )
    codes += [
        f"open({str(keep)!r}, 'w').write('pwned')",
        f"open({str(keep)!r}, 'a').write('pwned')",
        f"open({str(new)!r}, 'x').write('pwned')",
        f"import os\nos.truncate({str(keep)!r}, 0)",
        f"import os\nos.rename({str(keep)!r}, {str(new)!r})",
        f"import subprocess\nsubprocess.run(['sh', '-c', 'echo pwned > {keep}; echo x >> {new}'], check=True)",
        f"import os\nassert os.system('echo pwned > {keep}') == 0",
    ]
    for code, (result, _) in zip(codes, attack_all(codes, hook)):
        assert result.passed == 0, code
    assert not new.exists() and not os.path.exists(stdlib_probe)


@needs_bwrap
@HOOK
def test_attack_forged_results(hook, bystanders):
    every_fd = "import os\nfor fd in range(1024):\n    try:\n        os.write(fd, {line!r})\n    except OSError:\n        pass\n"
    fake = b'{"passed": 1000, "error": null}'
    # Whatever looks like a token in the frames above the code (the old harness kept it in a local variable).
    frames = (
        "import sys\nf, found = sys._getframe(), []\nwhile f:\n"
        "    found += [v for v in f.f_locals.values() if isinstance(v, (str, bytes)) and len(v) == 32]\n"
        "    f = f.f_back\n"
    )
    codes = [
        "import json\nprint('3 passed')\nprint(json.dumps({'passed': 3, 'error': None}))\nimport sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        every_fd.format(line=fake) + "os._exit(0)",
        every_fd.format(line=b"0" * 32 + b" " + fake + b"\n") + "os._exit(0)",
        every_fd.format(line=b'{"passed": -5, "error": null}') + "os._exit(0)",
        every_fd.format(line=b'{"passed": true, "error": null}') + "os._exit(0)",
        frames + "import os\nfor t in found:\n    for fd in range(3, 64):\n        try:\n"
        "            os.write(fd, (t if isinstance(t, bytes) else t.encode()) + b' ' + " + repr(fake) + " + b'\\n')\n"
        "        except OSError:\n            pass\nos._exit(0)",
    ]
    tests = PASSES + ["assert False"] * 2  # 3 tests: the honest score of a completion that runs is 1/3
    for code, (result, _) in zip(codes, attack_all(codes, hook, tests=tests)):
        assert result.passed == 0 and result.total == 3 and result.error is not None, code
    # The limit of any sandbox: the worker runs the tests, so it can claim an in-range count on its own pipe (as an
    # always-equal object would make the tests pass). It can never claim more than the number of tests.
    in_range = every_fd.format(line=b'{"passed": 3, "error": null}') + "os._exit(0)"
    (result, _), *_ = attack_all([in_range], hook, tests=tests)
    assert 0 <= result.passed <= result.total == 3


@needs_bwrap
@HOOK
def test_attack_the_sandboxs_own_pipes(hook, bystanders):
    # The pipes between the trainer and the sandbox (the job in, bwrap's and the supervisor's output out) were held
    # by bwrap's pid 1, which the code could open through /proc/1/fd: it flooded the trainer's memory (+5 GiB in
    # 8 s through the stderr pipe) and could read the job pipe. No process the code can see may hold one now.
    every_descriptor = (
        "import os\nopened, pids = [], ['1']\ntry:\n    pids += [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "except OSError:\n    pass\nfor pid in set(pids) - {str(os.getpid())}:\n    for fd in range(64):\n"
        "        for flags in (os.O_WRONLY, os.O_RDONLY):\n            try:\n"
        "                os.close(os.open(f'/proc/{pid}/fd/{fd}', flags | os.O_NONBLOCK))\n"
        "                opened.append((pid, fd, flags))\n            except OSError:\n                pass\n"
    )
    flood = "f = open('/proc/1/fd/2', 'wb', buffering=0)\nwhile True:\n    f.write(b'x' * 1000000)\n"
    (found, _), (flooded, _) = attack_all([every_descriptor, flood], hook, tests=["assert opened == []"])
    assert (found.passed, found.error) == (1, None), found
    assert flooded.passed == 0 and "the code raised PermissionError" in flooded.error, flooded


@needs_bwrap
@HOOK
def test_attack_network(hook, bystanders):
    tcp, udp, unix = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_UNIX)
    abstract = f"\0grpo-sandbox-test-{os.getpid()}"
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    udp.bind(("127.0.0.1", 0))
    unix.bind(abstract)
    unix.listen()
    for s in (tcp, udp, unix):
        s.settimeout(0.2)
    port, uport = tcp.getsockname()[1], udp.getsockname()[1]
    codes = [
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')",
        f"import socket\nsocket.create_connection(('localhost', {port}), timeout=1)",
        f"import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.sendto(b'x', ('127.0.0.1', {uport}))",
        f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({abstract!r})",
        "import ctypes\nif ctypes.CDLL(None).socket(2, 1, 0) < 0:\n    raise OSError('socket refused')",
    ]
    try:
        for code, (result, _) in zip(codes, attack_all(codes, hook)):
            assert result.passed == 0, code
        for server in (tcp, unix):
            with pytest.raises(TimeoutError):
                server.accept()  # nothing ever connected
        with pytest.raises(TimeoutError):
            udp.recv(16)  # nothing ever arrived
    finally:
        for s in (tcp, udp, unix):
            s.close()


@needs_bwrap
@HOOK
def test_attack_fork_bomb(hook, bystanders):
    codes = [
        "import os\nwhile True:\n    os.fork()",
        "import subprocess, sys\nbomb = 'import os\\nwhile True:\\n    os.fork()'\n"
        "while True:\n    subprocess.Popen([sys.executable, '-c', bomb])",
        "import multiprocessing\ndef bomb():\n    while True:\n        multiprocessing.Process(target=bomb).start()\n"
        "bomb()",
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
    ]
    began = time.perf_counter()
    for code, (result, took) in zip(codes, attack_all(codes, hook)):
        assert result.passed == 0 and took < LIMITS["wall_seconds"] + 2, code
    assert time.perf_counter() - began < 8
    assert subprocess.run(["true"]).returncode == 0  # the machine can still start processes


@needs_bwrap
def test_the_kernel_refuses_new_processes_but_allows_threads():
    # Without the audit hook, only the worker's seccomp filter stands between the code and fork.
    code = (
        "import os, threading\ntry:\n    os.fork()\n    forked = True\nexcept PermissionError:\n    forked = False\n"
        "t = threading.Thread(target=print)\nt.start()\nt.join()"
    )
    result = run_python(code, ["assert not forked"], Limits(**LIMITS), audit_hook=False)
    assert (result.passed, result.error) == (1, None)


@needs_bwrap
@HOOK
def test_attack_memory(hook, bystanders):
    codes = [
        "x = bytearray(4 * 1024**3)",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10**8))",
        "import mmap\nm = mmap.mmap(-1, 4 * 1024**3)\nm[::4096] = b'x' * (4 * 1024**3 // 4096)",
        "x = [0] * (10**9)",
    ]
    for code, (result, took) in zip(codes, attack_all(codes, hook)):
        assert result.passed == 0 and took < LIMITS["wall_seconds"] + 2, code


@needs_bwrap
def test_the_private_tmp_directory_is_bounded_and_the_only_writable_place():
    # It is a tmpfs (memory) of Limits.disk_mb: filling it stops at the limit, not at the host's RAM.
    code = (
        "written = 0\ntry:\n    for i in range(100):\n        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x' * 8 * 1024**2)\n        written += 8\nexcept OSError:\n    pass"
    )
    result = run_python(code, ["assert written <= 32"], Limits(**LIMITS, disk_mb=32), audit_hook=False)
    assert (result.passed, result.error) == (1, None)
    # Nothing else is writable: not the sandbox's root or /dev (tmpfs too, but unbounded), nor the bound system.
    code = "import os\nwritable = []\nfor d in ('/', '/dev', '/dev/shm', '/proc', '/usr/lib', os.path.dirname(os.__file__)):"
    code += "\n    try:\n        open(os.path.join(d, 'probe'), 'w').close()\n        writable.append(d)\n    except OSError:\n"
    code += "        pass"
    result = run_python(code, ["assert writable == []"], Limits(**LIMITS), audit_hook=False)
    assert (result.passed, result.error) == (1, None)


@needs_bwrap
def test_only_the_interpreter_and_system_libraries_are_in_view(tmp_path):
    # The project, its virtual environment, the test's files and the system's configuration are all out of view.
    hidden = [os.getcwd(), sys.prefix, str(tmp_path), "/etc/passwd", "/usr/bin", "/var", "/home"]
    code = f"import os\nseen = [p for p in {hidden!r} if os.path.exists(p)]\ntop = sorted(os.listdir('/'))"
    tests = ["assert seen == []", "assert set(top) <= {'dev', 'lib', 'lib64', 'proc', 'tmp', 'usr', 'root'}"]
    result = run_python(code, tests, Limits(**LIMITS), audit_hook=False)
    assert (result.passed, result.error) == (2, None)


@needs_bwrap
@HOOK
def test_attack_time(hook, bystanders):
    codes = [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        "import threading\ndef spin():\n    while True:\n        pass\nt = threading.Thread(target=spin)\nt.start()\nt.join()",
        "import select\nselect.select([], [], [])",
    ]
    for code, (result, took) in zip(codes, attack_all(codes, hook)):
        assert result.passed == 0 and took < LIMITS["wall_seconds"] + 2, code
        assert "CPU limit" in result.error or "timed out" in result.error or "killed" in result.error, result


# ---- test cases: the verdict computed outside the process that ran the code ----

# Wrong code (it subtracts) and the cases it must fail; no attack below may make them pass.
WRONG_ADD = "def add(a, b):\n    return a - b\n"
ADD_CASES = [
    {"call": "add(1, 2)", "expected": 3},
    {"call": "add(2, 5)", "expected": 7},
    {"call": "add(9, 0)", "expected": 9},
]
# The worker's frame (harness.work), found by walking up from the code's: it holds the job and the result pipe.
WORKER_FRAME = (
    "import sys\nworker = sys._getframe(1)\nwhile 'out' not in worker.f_locals:\n    worker = worker.f_back\n"
)
# What the documented limit of tests (not cases) needs: a few lines that find the worker's result pipe in its frame
# and report every test passed (the supervisor accepts any count in range).
FRAMES_FAKE = (
    WORKER_FRAME + "import os\nos.write(worker.f_locals['out'], b'{\"passed\": 3, \"error\": null}')\nos._exit(0)\n"
)
ALWAYS_EQUAL = "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"


@needs_bwrap
def test_cases_score_calls_and_programs_and_say_why_a_case_failed():
    right = "def add(a, b):\n    return a + b\n"
    result = run_cases(right, ADD_CASES + [{"call": "add([1], [2.0])", "expected": [1, 2]}], Limits(**LIMITS))
    assert (result.passed, result.total, result.error, result.failures) == (4, 4, None, ())
    result = run_cases(WRONG_ADD, ADD_CASES, Limits(**LIMITS))
    assert result.passed == 1 and result.failures == (
        "case 0 (add(1, 2)): returned -1, expected 3",
        "case 1 (add(2, 5)): returned -3, expected 7",
    )
    program = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\nexit(0)\n"
    cases = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5", "stdout": "10  \n\n"}, {"stdin": "x", "stdout": ""}]
    result = run_cases(program, cases, Limits(**LIMITS))
    assert result.passed == 2 and len(result.failures) == 1 and "raised ValueError" in result.failures[0]
    assert run_cases("print(int(input()) * 2)", '[{"stdin": "21", "stdout": "42"}]', Limits(**LIMITS)).passed == 1
    # The input is descriptor 0 as well, for programs that read it with open(0) or os.read; each case has its own
    # (open(0) closes descriptor 0 when its file object goes).
    cases = [{"stdin": "1 2 3", "stdout": "6"}, {"stdin": "4 5", "stdout": "9"}]
    assert run_cases("print(sum(map(int, open(0).read().split())))", cases, Limits(**LIMITS)).passed == 2
    assert run_cases("import os\nprint(sum(map(int, os.read(0, 99).split())))", cases, Limits(**LIMITS)).passed == 2


@needs_bwrap
@HOOK
def test_attack_forged_results_with_cases(hook, bystanders):
    # Every fake that works (or worked) on tests, against cases: each must score 0 of 3, hook or no hook.
    every_fd = "import os\nfor fd in range(1024):\n    try:\n        os.write(fd, {line!r})\n    except OSError:\n        pass\n"
    claims = [
        b'{"passed": 3, "error": null}',
        b'{"results": [[true, true], [true, true], [true, true]], "error": null}',
        b'{"results": [[true, 0], [true, 0], [true, 0]], "error": null}',
    ]
    codes = {
        "frames": WRONG_ADD + FRAMES_FAKE,
        # The same frame, asked for the cases' expected values: the job it holds has none, so it can only guess.
        "frames, results": WRONG_ADD + WORKER_FRAME + "import json, os\njob = worker.f_locals['job']\n"
        "claim = [[True, c.get('expected', True)] for c in job['cases']]\n"
        "os.write(worker.f_locals['out'], json.dumps({'results': claim, 'error': None}).encode())\n"
        "os._exit(0)\n",
        "always-equal": ALWAYS_EQUAL + "def add(a, b):\n    return Anything()\n",
        "int with a lying __eq__": "class Three(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\ndef add(a, b):\n    return Three(a - b)\n",
        "list of always-equal": ALWAYS_EQUAL + "def add(a, b):\n    return [Anything()]\n",
        **{
            f"every descriptor {i}": WRONG_ADD + every_fd.format(line=claim) + "os._exit(0)"
            for i, claim in enumerate(claims)
        },
        "printed": WRONG_ADD + "import json\nprint('3 passed')\nprint(json.dumps({'passed': 3, 'error': None}))\n"
        "import sys\nsys.exit(0)",
        "exits at the first call": "import os\ndef add(a, b):\n    os._exit(0)\n",
        "raises": "def add(a, b):\n    raise ValueError('no')\n",
        "raises at top level": "raise SystemExit(0)\ndef add(a, b):\n    return a + b\n",
        "times out": "def add(a, b):\n    while True:\n        pass\n",
    }
    results = attack_all(list(codes.values()), hook, cases=ADD_CASES)
    for name, (result, _) in zip(codes, results):
        assert result.passed == 0 and result.total == 3, (name, result)
    by_name = dict(zip(codes, (r for r, _ in results)))
    assert "not plain data" in by_name["always-equal"].failures[0]
    assert "type Three" in by_name["int with a lying __eq__"].failures[0]
    assert "timed out" in by_name["times out"].error or "CPU limit" in by_name["times out"].error


@needs_bwrap
@HOOK
def test_programs_cannot_fake_their_output(hook, bystanders):
    # Program-style cases: printing to the real stdout (fd 1), a report claiming a pass on every descriptor, or
    # exiting with an error status passes nothing. (A report can only say what the program printed, which the trainer
    # compares: claiming "3\n" is no more than printing it, so the forged report claims a pass, or "4\n".)
    every_fd = "import os\nfor fd in range(1024):\n    try:\n        os.write(fd, {line!r})\n    except OSError:\n        pass\n"
    codes = [
        "import os\nos.write(1, b'3\\n')\n",
        every_fd.format(line=b'{"passed": 1, "error": null}') + "os._exit(0)\n",
        every_fd.format(line=b'{"results": [[true, "4\\n"]], "error": null}') + "os._exit(0)\n",
        "import sys\nprint(3)\nsys.exit(1)\n",
        "while True:\n    print('3')\n",  # prints without end: past the results' bytes, the case fails
    ]
    for code, (result, _) in zip(codes, attack_all(codes, hook, cases=[{"stdin": "1 2\n", "stdout": "3\n"}])):
        assert result.passed == 0 and result.total == 1, (code, result)


@needs_bwrap
def test_the_expected_values_never_enter_the_sandbox(monkeypatch):
    # All that enters the sandbox is its command line, a fixed environment and the job written to its stdin: the
    # job holds each call, never the value it must return (nor a program's expected stdout).
    sent = []
    communicate = sandbox._communicate
    monkeypatch.setattr(
        sandbox,
        "_communicate",
        lambda proc, payload, *a, **k: sent.append(payload) or communicate(proc, payload, *a, **k),
    )
    cases = [{"call": "f()", "expected": "expected-value-6f1d"}, {"call": "g()", "expected": 982451653}]
    assert run_cases("def f():\n    return 1\ng = f", cases, Limits(**LIMITS)).passed == 0
    assert run_cases("print(1)", [{"stdin": "in-7c2a", "stdout": "printed-9be4"}], Limits(**LIMITS)).passed == 0
    assert len(sent) == 2 and b'"call": "f()"' in sent[0] and b"in-7c2a" in sent[1]
    for secret in (b"expected-value-6f1d", b"982451653", b"printed-9be4", b"expected", b"stdout"):
        assert not any(secret in payload for payload in sent), secret


@needs_bwrap
def test_tests_not_cases_can_be_fooled_the_documented_limit():
    # The limit docs/rewards.md states for tests: they run in the process that ran the code, so wrong code passes
    # them all, with one line a policy can learn (or an always-equal result). The same completions score 0 on cases.
    tests = ["assert add(1, 2) == 3", "assert add(2, 5) == 7", "assert add(0, 9) == 9"]
    always_equal = ALWAYS_EQUAL + "def add(a, b):\n    return Anything()\n"
    for code in (WRONG_ADD + FRAMES_FAKE, always_equal):
        assert run_python(code, tests, Limits(**LIMITS)).passed == 3
        assert run_cases(code, ADD_CASES, Limits(**LIMITS)).passed == 0


@needs_bwrap
def test_code_execution_reads_cases_or_tests_and_warns_about_tests():
    reward = code_execution(**LIMITS)
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    as_json = json.dumps(ADD_CASES[:2])  # a datasets column holds one type: JSON text of each row's cases
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cases alone: no warning
        assert reward([right, WRONG_ADD + FRAMES_FAKE, right], cases=[ADD_CASES, ADD_CASES, as_json]) == [
            1.0,
            0.0,
            1.0,
        ]
    with pytest.warns(UserWarning, match="the code can make them pass"):
        assert reward([right, right], tests=[["assert add(1, 2) == 3"], None], cases=[None, ADD_CASES]) == [1.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reward
        assert reward([right], tests=[["assert add(1, 2) == 3"]]) == [1.0]
    assert reward([right, right], cases=[None, []]) == [None, None]
    with pytest.raises(ValueError, match="row 1 has both `cases` and `tests`"):
        reward([right, right], tests=[None, ["assert True"]], cases=[ADD_CASES, ADD_CASES])
    with pytest.raises(ValueError, match="row 0: Case 0 has a call and has no 'expected'"):
        reward([right], cases=[[{"call": "add(1, 2)"}]])
    with pytest.raises(TypeError, match="needs a `cases` column"):
        reward([right])


def test_malformed_cases_are_refused_with_the_fix():
    assert check_cases({"call": "f((1, 2))", "expected": (1, [2])}) == [{"call": "f((1, 2))", "expected": [1, [2]]}]
    # A datasets column holding both kinds fills each dict with the other kind's keys, set to None.
    filled = {"call": None, "expected": None, "stdin": None, "stdout": "1\n"}
    assert check_cases([filled]) == [{"stdin": "", "stdout": "1\n"}]
    assert check_cases([{"call": "f()", "expected": None, "stdin": None, "stdout": None}])[0]["expected"] is None
    for cases, message in [
        ("[{", "text but not JSON"),
        (7, "give a list of cases"),
        (["f() == 1"], "Case 0 is a str"),
        ([{"call": "f()", "expect": 1}], "unknown keys \\['expect'\\]"),
        ([{"call": "f()"}], "has no 'expected'"),
        ([{"call": "x = 1", "expected": 1}], "not a Python expression"),
        ([{"call": "f()", "expected": {1, 2}}], "an object of type set"),
        ([{"call": "f()", "expected": {1: "a"}}], "a key of type int"),
        ([{"call": "f()", "expected": 1, "stdout": "1"}], "also has \\['stdout'\\]"),
        ([{"stdin": "1"}], "neither a call nor a stdout"),
        ([{"stdin": 1, "stdout": "1"}], "must be text"),
        ([{"call": "f()", "expected": 1}, {"stdin": "", "stdout": "1"}], "mix calls and programs"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_cases(cases)


def test_results_are_compared_outside_by_json_rules_only():
    # The comparison is the trainer's, on values JSON made: numbers by value, but a bool is not a number.
    assert same(3, 3.0) and same([1, {"a": [None, "x"]}], [1.0, {"a": [None, "x"]}])
    for got, expected in [
        (True, 1),
        (1, True),
        ("3", 3),
        ([1, 2], [1, 2, 3]),
        ({"a": 1}, {"a": 1, "b": 2}),
        (None, 0),
        (float("nan"), float("nan")),
        ([[1]], [1]),
    ]:
        assert not same(got, expected), (got, expected)
    assert same_output("3  \n\n", "3") and same_output("a\nb", "a \nb\n") and not same_output("3\n4", "3 4")
    cases = check_cases(ADD_CASES)
    passed, failures = judge(cases, [[True, 3], [True, 7.0], [False, "raised ValueError: no"]])
    assert passed == 2 and failures == ("case 2 (add(9, 0)): raised ValueError: no",)


def test_the_results_in_a_report_are_checked_again():
    token = "cd" * 16

    def line(results):
        return f'{token} {{"passed": 0, "error": null, "output_bytes": 0, "results": {results}}}\n'.encode()

    assert sandbox._parse_report(line('[[true, 3], [false, "why"]]'), token, 2, cases=True)[4] == [
        [True, 3],
        [False, "why"],
    ]
    for bad in [
        "null",  # no results and no error
        "[[true, 3]]",  # one entry for two cases
        "[[true, 3], [false, 3]]",  # a failed case's reason is text
        '[[true, 3], ["true", 3]]',
        "[[true, 3], [true, 3, 3]]",
        "[[true, 3], " + "[" * 5000 + "]" * 5000 + "]",  # nested past what JSON (or the check) takes
        "[[true, 3], [true, " + "[" * 150 + "]" * 150 + "]]",
    ]:
        assert sandbox._parse_report(line(bad), token, 2, cases=True) is None, bad
    # The error of a failed run needs no results.
    failed = f'{token} {{"passed": 0, "error": "timed out", "output_bytes": 0, "results": null}}\n'.encode()
    assert sandbox._parse_report(failed, token, 2, cases=True) == (0, 2, "timed out", 0, None)


def test_the_comparisons_docstring_examples_run():
    import doctest

    import grpo.rewards.sandbox.cases as cases

    results = doctest.testmod(cases)
    assert results.attempted >= 2 and results.failed == 0


# ---- the result channel, the weaker mode, and a missing bubblewrap ----


def test_the_report_is_validated_and_clamped():
    token = "ab" * 16
    good = f'{token} {{"passed": 2, "error": null, "output_bytes": 5, "results": null}}\n'.encode()
    assert sandbox._parse_report(good, token, 3) == (2, 3, None, 5, None)
    assert sandbox._parse_report(good.replace(b"2", b"7"), token, 3) == (3, 3, None, 5, None)  # clamped to total
    for bad in (
        good.replace(token.encode(), b"0" * 32),  # wrong token
        good + good,  # two lines
        good.rstrip(),  # no newline
        f'{token} {{"passed": true, "error": null, "output_bytes": 0}}\n'.encode(),
        f'{token} {{"passed": 1.5, "error": null, "output_bytes": 0}}\n'.encode(),
        f'{token} {{"passed": 1, "error": 7, "output_bytes": 0}}\n'.encode(),
        f'{token} {{"passed": 1, "error": null, "output_bytes": "5"}}\n'.encode(),
        f'{token} {{"passed": 1, "error": null, "results": null}}\n'.encode(),  # no output_bytes
        f"{token} [1, 2]\n".encode(),
        f"{token} not json\n".encode(),
        b"",
    ):
        assert sandbox._parse_report(bad, token, 3) is None, bad


def test_the_trainer_keeps_a_bounded_amount_of_the_sandboxs_output():
    # Whatever writes to the pipes the trainer reads, it holds at most PIPE_BYTES of each and closes a pipe past that
    # (communicate() used to buffer all of it). The job, larger than a pipe's buffer, still arrives whole. The report
    # pipe is read beside them (a report larger than a pipe's buffer arrives whole), up to its limit and one byte.
    report_r, report_w = os.pipe()
    flood = (
        "import os, sys\nassert sys.stdin.buffer.read() == b'job' * 10**5\nopen_fds = {1, 2}\n"
        f"os.write({report_w}, b'r' * 100_100)\n"
        "for _ in range(100):\n    for fd in sorted(open_fds):\n        try:\n            os.write(fd, b'x' * 10**6)\n"
        "        except BrokenPipeError:\n            open_fds.discard(fd)\n"
        "sys.exit(3 if not open_fds else 0)\n"  # 3: both pipes were closed on it
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", flood],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=[report_w],
    )
    os.close(report_w)
    try:
        out, err, report = sandbox._communicate(proc, b"job" * 10**5, 120, report_r, report_bytes=100_000)
    finally:
        os.close(report_r)
    assert out == err == b"x" * sandbox.PIPE_BYTES
    assert report == b"r" * 100_001  # its limit and one byte more, which marks it as too long
    assert proc.returncode == 3  # both pipes were closed on it before it wrote 100 MB to each


def test_process_isolation_is_a_named_opt_in_and_still_scores():
    reward = code_execution(**LIMITS, isolation="process")
    forged = 'import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b\'{"passed": 9, "error": null}\')\n'
    forged += "    except OSError:\n        pass\nos._exit(0)"
    assert reward(["def f():\n    return 1", "import os\nos._exit(0)", forged], tests=[["assert f() == 1"]] * 3) == [
        1.0,
        0.0,
        0.0,
    ]
    # Cases too: the verdict is computed outside the process that ran the code in this mode as well.
    right = "def add(a, b):\n    return a + b\n"
    assert reward([right, WRONG_ADD + FRAMES_FAKE], cases=[ADD_CASES] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="isolation='docker'"):
        code_execution(isolation="docker")


needs_seccomp = pytest.mark.skipif(
    sandbox.seccomp_programs() is None, reason="libseccomp.so.2 is not installed: apt-get install libseccomp2"
)


@needs_seccomp
@HOOK
def test_process_isolation_cannot_signal_the_trainers_processes(hook, bystanders):
    # isolation="process" shows the trainer's processes; pidfd_open + pidfd_send_signal went past the audit hook.
    # The worker's seccomp filter refuses every signal and trace, so the kernel stops it with or without the hook.
    # (Only the victim is aimed at: were the filter missing, kill(-1) as this user would end the test run.)
    victim, _ = bystanders
    libc = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    codes = [
        f"import os, signal\nsignal.pidfd_send_signal(os.pidfd_open({victim.pid}), 9)",
        f"import os\nos.kill({victim.pid}, 9)",
        libc + f"if libc.kill({victim.pid}, 9) != 0:\n    raise OSError(ctypes.get_errno(), 'refused')",
        # The known way round the hook (its path checks through replaced os.path functions), then a pidfd from /proc
        "import os, signal\nos.path.realpath = lambda p, *a, **k: os.getcwd()\nos.path.isdir = lambda p: False\n"
        f"signal.pidfd_send_signal(os.open('/proc/{victim.pid}', os.O_RDONLY), 9)",
    ]
    for code in codes:
        result = run_python(code, PASSES, Limits(**LIMITS), isolation="process", audit_hook=hook)
        assert result.passed == 0 and "PermissionError" in result.error, (code, result)
    time.sleep(0.1)  # a signal, had one been sent, has landed


def test_the_audit_hook_uses_the_path_functions_it_started_with(tmp_path):
    # Replacing os.path.realpath and os.path.isdir used to walk round the hook's file checks in isolation="process"
    # (read /etc/passwd, empty a file of the trainer's). The hook keeps its own references now. It stays one layer:
    # the docs say what still walks round it.
    keep = tmp_path / "keep.txt"
    keep.write_text("keep me")
    bypass = "import os\nos.path.realpath = lambda p, *a, **k: os.getcwd()\nos.path.isdir = lambda p: False\n"
    # With os.stat failing, a directory passed the hook's "not a directory" check: a descriptor of the standard
    # library's folder, and then dir_fd= paths, which the hook reads as relative to the working directory.
    no_stat = "import os\ndef fail(*a, **k):\n    raise OSError\nos.stat = fail\n"
    codes = [
        bypass + "open('/etc/passwd').read()",
        bypass + f"open({str(keep)!r}, 'w').close()",
        no_stat + f"fd = os.open({sandbox.stdlib_dirs()[0]!r}, os.O_RDONLY)",
    ]
    for code in codes:
        result = run_python(code, PASSES, Limits(**LIMITS), isolation="process")
        assert result.passed == 0 and "sandbox: opening" in result.error, (code, result)
    assert keep.read_text() == "keep me"


def test_without_bubblewrap_the_sandbox_refuses_and_says_how_to_fix_it(monkeypatch):
    sandbox._bwrap_problem.cache_clear()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as refused:
            code_execution(**LIMITS)
        assert "isolation='process'" in str(refused.value)
        with pytest.raises(SandboxUnavailable, match="bwrap"):
            run_python("x = 1", PASSES)
        assert run_python("x = 1", PASSES, isolation="process").passed == 1
    finally:
        sandbox._bwrap_problem.cache_clear()


def test_ci_runs_the_bubblewrap_tier():
    # Without this, CI without bubblewrap would skip every attack test above and still go green.
    if not os.environ.get("CI"):
        pytest.skip("only enforced under CI=1; locally the bubblewrap tests skip when bwrap is missing")
    assert HAS_BWRAP, "CI must have bubblewrap: `.ci/run` installs it as root, or run `apt-get install bubblewrap`"
    sandbox.check_isolation("bwrap")  # and it can start a sandbox here
