"""Running untrusted code (a model's completion) against tests, contained by the operating system.

    add = "def add(a, b):\n    return a + b"
    result = run_cases(add, [{"call": "add(1, 2)", "expected": 3}], Limits(wall_seconds=5))
    result.passed, result.total, result.error      # 1, 1, None
    run_cases("print(sum(map(int, input().split())))", [{"stdin": "1 2\n", "stdout": "3\n"}]).passed   # 1
    run_python(add, ["assert add(1, 2) == 3"]).passed   # 1 (tests that run beside the code, which can fake them)
    run_python("print(6 * 7)", []).output          # '42\n' (what the code printed: stdout and stderr)

Isolation (`isolation=`, default "bwrap"; the threat model and its limits are in docs/rewards.md):
  - "bwrap": the child runs under bubblewrap (`apt-get install bubblewrap`) in new user, PID, mount, network, IPC,
    UTS and cgroup namespaces, as uid 65534 with every capability dropped, nested user namespaces disabled, in its
    own session, and dies with the trainer (`--die-with-parent`, then the PID namespace). Its file system is read-only and holds only the
    interpreter, its standard library and /usr/lib (no /etc, no home, no project files); a private tmpfs of
    `disk_mb` at /tmp is its working directory and the only writable place. /proc is that of its own PID namespace:
    no process outside the sandbox can be seen, signalled or traced. The network namespace has only its own
    loopback. A seccomp filter (built with libseccomp through ctypes, when libseccomp.so.2 is installed) refuses
    ptrace, other processes' memory, mounts, namespaces, keyrings, bpf, perf, io_uring, userfaultfd, modules and
    every socket but AF_UNIX. The harness's supervisor is the namespace's pid 1 (no bwrap init holds the trainer's
    pipes there) and is not dumpable, so no /proc/PID/fd in view leads back to the trainer; the trainer reads at
    most PIPE_BYTES of each output pipe (`_communicate`). If bwrap is missing or cannot start here, `run_python`
    raises `SandboxUnavailable`.
  - "process": the weaker mode, used only when asked for by name: a plain child process as the trainer's user, with
    the same limits, worker filter and audit hook, a throwaway working directory, and a network namespace only where
    the kernel allows one. The kernel (the worker's filter) keeps the trainer's processes from being signalled or
    traced; nothing but the audit hook, which Python code can walk around, keeps the code from the files the
    trainer's user may read or write.

Lifetime, in both modes (docs/rewards.md, "The sandbox's lifetime"): before it reads the job, the supervisor sets a
parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL), exits at once if its parent is already gone (getppid(); under
bubblewrap the parent is outside its PID namespace, and bwrap's --die-with-parent does this), and arms a SIGALRM
timer for the wall limit, at which it kills the worker's process group and reports the timeout; the worker, in a
group of its own, dies with the supervisor the same way. So the code ends at its wall limit with no help from the
trainer, and with the trainer, even one killed with SIGKILL. A run started within a `CallScope`
(grpo/generation/call_scope.py: a tool or reward call with a timeout) is killed when that call is abandoned, and none
starts in an abandoned one. Linux only: elsewhere `check_isolation` raises `SandboxUnavailable`.

In both modes the process that runs the code (the worker) has rlimits (CPU seconds, address space, file size, open
files; processes in "bwrap"), a second seccomp filter that refuses fork, clone of a process, exec, every signal
(kill, tgkill, pidfd_send_signal, sigqueue: to itself too) and every trace (threads stay allowed), and a `sys.addaudithook` hook that refuses sockets, new processes, signals, ctypes and files outside
the working directory. The hook is an extra layer only: Python code can walk around it, the layers above it not.

Two ways to check the code. `run_cases` (test cases: a call and the value it must return, or a program's stdin and
what it must print; cases.py) computes the verdict outside the sandbox: only the calls or the stdin texts enter it,
the worker sends back what each call returned or each run printed as plain JSON data (at most RESULT_BYTES), and
the trainer compares that with the expected values, which never enter the sandbox. The code cannot know what to
report, and no object of its own crosses the boundary. `run_python` (tests: snippets that raise when they fail) runs
the tests in the worker, beside the code, which can therefore make them pass.

The reported result is validated twice. Inside the sandbox a supervisor process reads the job, forks the worker,
and only then reads a random token, so the worker's memory never holds it. The worker closes the report pipe (the
supervisor is not dumpable and ptrace is filtered, so it cannot reopen it) and sends its count through a pipe of
its own; the supervisor accepts only a well-formed count with 0 <= passed <= total and writes it, with the token,
to the report pipe, where the trainer checks the token, the format and the range again. Exiting early, printing
results, writing to inherited descriptors or claiming more passes than tests gives no pass. With tests (not
cases), what no sandbox can prevent: the worker runs the tests, so code that subverts them in its own process (an
`__eq__` that is always True, or a forged count on its own pipe) can score up to `total`, never more.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo.generation.call_scope import current_scope
from grpo.rewards.sandbox.bwrap import bwrap_argv, stdlib_dirs
from grpo.rewards.sandbox.cases import case_inputs, check_cases, judge
from grpo.rewards.sandbox.harness import MARKER, well_formed_results
from grpo.rewards.sandbox.seccomp import seccomp_programs

ISOLATIONS = ("bwrap", "process")

# The sandboxed runs in progress in this process, so that `stop_running` (Ctrl-C) can end them at once: the threads
# a reward runs them in would otherwise wait out each run's wall-clock limit before the process could exit.
# Each with the function that kills it (`_signal_group`).
_running: dict[subprocess.Popen, functools.partial] = {}
_running_lock = threading.Lock()
_stops = 0  # how often stop_running was called

# The program run inside the sandbox (harness.py: a supervisor, then the worker it forks), passed as the source text
# of `python -c`, so that it needs no path inside the sandbox's file system.
HARNESS = (Path(__file__).parent / "harness.py").read_text()
# The most of what the code prints (stdout and stderr) a run reports; the rest is counted, not kept.
OUTPUT_BYTES = 16 * 1024
# The most the trainer reads from each of the sandbox's stdout and stderr: past it the pipe is closed, so nothing in
# the sandbox can make the trainer hold more (the supervisor writes at most OUTPUT_BYTES there, bwrap a few lines).
PIPE_BYTES = 4 * OUTPUT_BYTES
# How long past the wall limit the trainer waits for the supervisor, which enforces the limit itself and reports the
# timeout, before it kills the sandbox on its own (the supervisor gives up on its report REPORT_GRACE, 0.5 s, after).
WALL_GRACE = 1.0
# The most the results of a run's test cases (what the calls returned, what the programs printed) may take as JSON;
# a case whose result does not fit fails. The trainer reads no more than this (and a few bytes per case) of a report.
RESULT_BYTES = 256 * 1024


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0  # whole run, including interpreter start-up
    cpu_seconds: int = 10  # RLIMIT_CPU of the process running the code
    memory_mb: int = 512  # RLIMIT_AS (address space) of each process
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file the code may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_processes: int = 16  # RLIMIT_NPROC in the sandbox's user namespace: its processes and threads; "bwrap" only
    disk_mb: int = 64  # size of the private /tmp (a tmpfs, so it is memory); "bwrap" only

    def __post_init__(self):
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)} must be > 0.")


@dataclass(frozen=True)
class SandboxResult:
    passed: int  # tests that ran without raising, 0 <= passed <= total
    total: int
    error: str | None  # why the run did not complete: timeout, a limit, an exception in the code, a refused action
    output: str = ""  # what the code printed to stdout and stderr, its first OUTPUT_BYTES (UTF-8, bad bytes replaced)
    output_bytes: int = 0  # how many bytes it printed in all (more than `output` holds when it was cut)
    failures: tuple[str, ...] = ()  # run_cases: why each failed case failed (empty when `error` says the run did)


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot run on this machine (the message says how to fix it)."""


def run_python(
    code: str, tests: list[str], limits: Limits | None = None, *, isolation: str = "bwrap", audit_hook: bool = True
) -> SandboxResult:
    """Run `code`, then each test (a snippet that raises, typically with `assert`, when it fails), in one sandboxed
    child process; count the tests that pass. Never raises for anything the code does; raises
    `SandboxUnavailable` when the isolation asked for cannot run here. `audit_hook=False` leaves out the
    Python-level layer (the tests use it to check that the OS layers hold on their own)."""
    check_isolation(isolation)
    return _run(code, list(tests), limits or Limits(), isolation, audit_hook)


def run_cases(
    code: str, cases, limits: Limits | None = None, *, isolation: str = "bwrap", audit_hook: bool = True
) -> SandboxResult:
    """Run `code` in the sandbox against test cases and count those it passes, the verdict computed here, outside
    the process that ran the code. `cases` (a list, one dict, or JSON text of either; `check_cases`) are all
    `{"call": "add(1, 2)", "expected": 3}`: the code runs once, then each call is evaluated in its namespace and must
    return a value equal to `expected` as JSON data (`same`); or all `{"stdin": "1 2\n", "stdout": "3\n"}`: the
    code runs as a program once per case, reading `stdin` from `sys.stdin` (and descriptor 0), and what it prints
    to `sys.stdout` must be `stdout` up to trailing whitespace (`same_output`). A call or program that raises, returns anything but plain
    data, or exits with a status other than 0 fails its case; a failed run (timeout, a limit, a syntax error, an
    exception in the code before the calls) sets `error` and passes none. `failures` says why each case failed.
    Raises ValueError for malformed cases, `SandboxUnavailable` when the isolation cannot run here."""
    check_isolation(isolation)
    cases = check_cases(cases)
    return _run(code, [], limits or Limits(), isolation, audit_hook, cases)


def check_isolation(isolation: str = "bwrap") -> None:
    """Raise `SandboxUnavailable`, saying how to fix it, when `isolation` cannot run on this machine."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r}: use one of {ISOLATIONS}.")
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(
            f"The code sandbox runs on Linux only (this is {sys.platform}): it needs the kernel's parent-death signal "
            "(prctl PR_SET_PDEATHSIG), so that sandboxed code dies with the trainer, and its namespaces and seccomp "
            "filters. Train with code rewards or the python tool in a Linux machine, container or VM."
        )
    if isolation == "bwrap":
        problem = _bwrap_problem()
        if problem:
            raise SandboxUnavailable(problem)


@functools.cache
def _bwrap_problem() -> str | None:
    weaker = "or accept the weaker, process-only sandbox by name with isolation='process' (docs/rewards.md)"
    if shutil.which("bwrap") is None:
        return (
            "The code sandbox needs bubblewrap (`bwrap`), which is not installed: run `apt-get install bubblewrap` "
            f"(Debian, Ubuntu; `dnf install bubblewrap` on Fedora), {weaker}."
        )
    result = _run("", ["assert True"], Limits(wall_seconds=30), "bwrap", True)
    if result.passed != 1:
        return (
            f"bubblewrap is installed but could not start a sandbox here ({result.error}). It needs user "
            "namespaces: check `sysctl kernel.unprivileged_userns_clone` (1) and, on Ubuntu 24.04, "
            "`kernel.apparmor_restrict_unprivileged_userns` (0); in a container, allow them (e.g. docker "
            f"--security-opt seccomp=unconfined --security-opt apparmor=unconfined), {weaker}."
        )
    return None


def _run(
    code: str, tests: list[str], limits: Limits, isolation: str, audit_hook: bool, cases: list[dict] | None = None
) -> SandboxResult:
    """One sandboxed run (`run_python`, `run_cases`): the job and a fresh token sent to the harness, its report read
    and checked (`_result`); the process group, its pipes and its working directory are gone when it returns. The
    harness enforces `limits.wall_seconds` itself; this process kills it WALL_GRACE later if it has not ended."""
    total = len(tests) if cases is None else len(cases)
    scope = current_scope()
    if scope is not None and scope.abandoned:  # the call this run is for timed out: start nothing more for it
        return SandboxResult(0, total, "not run: the call it was for was abandoned at its timeout")
    report_r, report_w = os.pipe()
    programs = seccomp_programs()
    job = _job(code, tests, cases, limits, isolation, audit_hook, report_w, programs)
    token = secrets.token_hex(16)
    payload = json.dumps(job).encode()
    payload = str(len(payload)).encode() + b"\n" + payload + token.encode()
    fds, workdir, seccomp_fd = [report_w], None, None
    if isolation == "bwrap" and programs is not None:
        seccomp_fd = os.memfd_create("grpo-seccomp", 0)
        os.write(seccomp_fd, programs[0])
        os.lseek(seccomp_fd, 0, os.SEEK_SET)
        fds.append(seccomp_fd)
    elif isolation == "process":
        workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    try:
        deadline = time.monotonic() + limits.wall_seconds  # the harness's too: start-up counts
        harness = [MARKER, str(os.getpid() if isolation == "process" else 0), repr(deadline), str(limits.wall_seconds)]
        proc = _start(*_command(isolation, limits.disk_mb, seccomp_fd, workdir, harness), fds, scope)
        os.close(report_w)
        report_w = None
        report_bytes = RESULT_BYTES + 64 * total + 4096  # the results, a few bytes of each entry, the rest
        try:
            waited = limits.wall_seconds + WALL_GRACE
            printed, stderr, report = _communicate(proc, payload, waited, report_r, report_bytes)
        except subprocess.TimeoutExpired:
            return SandboxResult(0, total, f"timed out after {limits.wall_seconds} s")
        finally:
            _kill_group(proc)
            _forget(proc, scope)
        return _result(report, token, cases, total, printed, stderr, proc.returncode)
    finally:
        for fd in (report_r, report_w, seccomp_fd):
            if fd is not None:
                os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _command(
    isolation: str, disk_mb: int, seccomp_fd: int | None, workdir: str | None, harness: list[str]
) -> tuple[list, str, dict]:
    """(argv, working directory, environment) of the harness, given its arguments `harness` (harness.supervise):
    under bubblewrap, which installs the seccomp filter read from `seccomp_fd`, or as a plain child process in
    `workdir` ("process")."""
    interpreter = [sys.executable, "-I", "-S", "-B", "-c", HARNESS, *harness]
    if isolation == "bwrap":
        return bwrap_argv(disk_mb, seccomp_fd) + interpreter[1:], "/", {"PATH": os.environ.get("PATH", "")}
    return interpreter, workdir, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _start(argv: list, cwd: str, env: dict, fds: list[int], scope) -> subprocess.Popen:
    """The harness started, passed `fds`, and counted among the runs `stop_running` ends and, within a call's
    `CallScope` (grpo/generation/call_scope.py), among those its `abandon()` ends."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,  # what the code printed, passed on by the supervisor (at most OUTPUT_BYTES)
        stderr=subprocess.PIPE,  # bwrap's and the supervisor's messages only: the worker's go to its stdout
        pass_fds=fds,
        start_new_session=True,  # its own process group, killed as a whole by _kill_group
    )
    stop = functools.partial(_signal_group, proc)
    with _running_lock:
        _running[proc] = stop
    if scope is not None and not scope.enter(stop):  # abandoned while this run started
        stop()
    return proc


def _forget(proc: subprocess.Popen, scope) -> None:
    """`proc` ended: no longer among the runs `stop_running` or its scope's `abandon()` ends."""
    with _running_lock:
        stop = _running.pop(proc, None)
    if scope is not None and stop is not None:
        scope.leave(stop)


def _result(
    report: bytes, token: str, cases: list[dict] | None, total: int, printed: bytes, stderr: bytes, returncode: int
) -> SandboxResult:
    """The result of a finished run: its report checked (`_parse_report`) and, with cases, judged here, since the
    sandbox sent values only; without a valid report, no pass, and the harness's exit status and stderr say why."""
    parsed = _parse_report(report, token, total, cases is not None)
    if parsed is None:
        reason = f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        detail = stderr.decode(errors="replace").strip()[-500:]
        return SandboxResult(
            0, total, f"the sandbox ended without a result ({reason}){': ' + detail if detail else ''}"
        )
    passed, _, error, output_bytes, results = parsed
    failures = ()
    if cases is not None and error is None:
        passed, failures = judge(cases, results)
    output = printed[:OUTPUT_BYTES]
    return SandboxResult(
        passed, total, error, output.decode(errors="replace"), max(output_bytes, len(output)), failures
    )


def _job(code, tests, cases, limits, isolation, audit_hook, report_fd, programs) -> dict:
    """What the harness reads from its stdin: the code, the tests or the cases' inputs (never what they must return
    or print), the limits, the report pipe's descriptor and the worker's seccomp filter."""
    return {
        "code": code,
        "tests": tests,
        "cases": None if cases is None else case_inputs(cases),
        "result_bytes": RESULT_BYTES,
        "cpu": max(1, int(limits.cpu_seconds)),
        "memory_mb": int(limits.memory_mb),
        "file_size_mb": int(limits.file_size_mb),
        "max_open_files": int(limits.max_open_files),
        "nproc": int(limits.max_processes) if isolation == "bwrap" else 0,
        "stdlib": stdlib_dirs(),
        "report_fd": report_fd,
        "hook": audit_hook,
        "isolation": isolation,
        "output_bytes": OUTPUT_BYTES,
        "worker_seccomp": programs[1].hex() if programs is not None else None,
    }


def _communicate(
    proc: subprocess.Popen, payload: bytes, timeout: float, report_fd: int | None = None, report_bytes: int = 0
) -> tuple[bytes, bytes, bytes]:
    """`proc.communicate(payload, timeout)` with a bound: send `payload` to stdin while reading stdout and stderr as
    they arrive, keeping at most PIPE_BYTES of each; a stream that reaches it is closed (its writer gets EPIPE).
    Reads `report_fd` (the report pipe) beside them, up to `report_bytes` and one more (so a longer report is seen
    to be too long), until it closes. Returns (stdout, stderr, report); raises `subprocess.TimeoutExpired` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    streams = {proc.stdout.fileno(): proc.stdout, proc.stderr.fileno(): proc.stderr}
    kept = {fd: bytearray() for fd in streams}
    limits = dict.fromkeys(streams, PIPE_BYTES)
    if report_fd is not None:  # read as it arrives: a report larger than a pipe's buffer must not block its writer
        kept[report_fd], limits[report_fd] = bytearray(), report_bytes + 1
    stdin, sent = proc.stdin.fileno(), 0
    os.set_blocking(stdin, False)
    with selectors.DefaultSelector() as selector:
        selector.register(stdin, selectors.EVENT_WRITE)
        for fd in kept:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            for key, _ in selector.select(left):
                if key.fd == stdin:
                    try:
                        sent += os.write(stdin, payload[sent : sent + 65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the sandbox is gone: its exit status says why
                        sent = len(payload)
                    if sent >= len(payload):
                        selector.unregister(stdin)
                        proc.stdin.close()
                    continue
                chunk, buffer = os.read(key.fd, 65536), kept[key.fd]
                buffer += chunk[: limits[key.fd] - len(buffer)]
                if not chunk or len(buffer) >= limits[key.fd]:
                    selector.unregister(key.fd)
                    if key.fd in streams:  # the report pipe is the caller's to close
                        streams[key.fd].close()
    proc.wait(max(deadline - time.monotonic(), 0.0))
    report = bytes(kept.pop(report_fd)) if report_fd is not None else b""
    out, err = (bytes(kept[fd]) for fd in streams)
    return out, err, report


def _parse_report(
    data: bytes, token: str, total: int, cases: bool = False
) -> tuple[int, int, str | None, int, list | None] | None:
    """(passed, total, error, output_bytes, results) from the report line, or None unless it is exactly one
    well-formed line with the token and 0 <= passed <= total; with `cases`, and no error, `results` must be one
    well-formed entry per case (harness.well_formed_results: what each call returned as plain data, or why not)."""
    prefix = token.encode() + b" "
    if not data.startswith(prefix) or data.count(b"\n") != 1 or not data.endswith(b"\n"):
        return None
    try:
        report = json.loads(data[len(prefix) :].decode())
        passed, error, printed, results = report["passed"], report["error"], report["output_bytes"], report["results"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if type(passed) is not int or type(printed) is not int or not (error is None or isinstance(error, str)):
        return None
    if cases and error is None and not well_formed_results(results, total):
        return None
    results = results if cases and error is None else None
    return min(max(passed, 0), total), total, error if error is None else error[:500], max(printed, 0), results


def stop_running() -> None:
    """Kill every sandboxed run in progress in this process (the trainer calls it on Ctrl-C): each returns at once
    with an error ("killed by signal 9"). `stops()` counts the calls, so a caller can skip the runs it has not
    started yet."""
    global _stops
    with _running_lock:
        _stops += 1
        stops = list(_running.values())
    for stop in stops:
        stop()


def stops() -> int:
    """How often `stop_running` was called in this process."""
    return _stops


def _signal_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the harness's process group: under bubblewrap, bwrap, whose sandbox dies with it (--die-with-parent,
    then the PID namespace); as a plain process, the supervisor, whose worker (in a group of its own) dies with it
    (its parent-death signal). Not once the harness was reaped: its pid may be another process's by then."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc)
    proc.wait()
