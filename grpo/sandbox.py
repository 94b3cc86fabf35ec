"""Running untrusted code (a model's completion) against tests, in a separate, restricted Python process.

    result = run_python("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"], Limits(wall_seconds=5))
    result.passed, result.total, result.error      # 1, 1, None

What the child process gets (each layer is best effort; see docs/rewards.md for what this does not guarantee):
  - `python -I -S`: no user site, no site-packages, no PYTHON* variables; a minimal environment (no variable of
    the trainer's); a fresh temporary directory as working directory, deleted afterwards; its own session, so the
    whole process group is killed at the wall-clock timeout.
  - rlimits set in the child before the code runs: CPU seconds, address space, file size, open files, processes.
  - a new network namespace (no interface but a downed loopback) when the kernel allows it (root, or unprivileged
    user namespaces); otherwise only the audit hook below blocks the network.
  - a `sys.addaudithook` hook, installed before the untrusted code runs and impossible to remove from Python,
    that refuses sockets, new processes (fork, exec, subprocess, os.system), signals to other processes, ctypes,
    links, opening directories, and any file open, listing or change outside the working directory (reads of the
    standard library excepted).

The harness reports through a file outside the working directory, opened before the code runs, with a random
token, so a completion that exits early (`os._exit(0)`) or prints a fake result does not pass.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0  # whole run, including interpreter start-up
    cpu_seconds: int = 10  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS (address space)
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file the code may write
    max_open_files: int = 64  # RLIMIT_NOFILE

    def __post_init__(self):
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "file_size_mb", "max_open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)} must be > 0.")


@dataclass(frozen=True)
class SandboxResult:
    passed: int  # tests that ran without raising
    total: int
    error: str | None  # why the run did not complete: timeout, a limit, an exception in the code, a refused action


# The child's program. It receives a JSON job on stdin; everything after `_lock_down()` may be hostile.
_HARNESS = r"""
import json, os, sys

def _lock_down(job):
    import resource
    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", job["cpu"]), ("RLIMIT_AS", job["memory_mb"] * mb),
                        ("RLIMIT_FSIZE", job["file_size_mb"] * mb), ("RLIMIT_NOFILE", job["max_open_files"]),
                        ("RLIMIT_NPROC", 0), ("RLIMIT_CORE", 0)):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass
    try:  # a network namespace of our own; refused without privileges, then the audit hook is the only guard
        import ctypes
        ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
    except Exception:
        pass
    for name in ("ctypes", "_ctypes"):
        sys.modules.pop(name, None)

    workdir = os.path.realpath(os.getcwd())
    readable = [workdir] + [os.path.realpath(p) for p in job["stdlib"]]
    inside = lambda path, roots: any(path == r or path.startswith(r + os.sep) for r in roots)

    def real(path):
        if isinstance(path, int):  # an already open descriptor
            return None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return os.path.realpath(os.fspath(path))  # relative to the current directory, wherever that is

    refused = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
               "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
               "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
               "ctypes.call_function", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.chroot",
               "sys._current_frames", "resource.setrlimit", "resource.prlimit",
               "os.symlink", "os.link"}  # links could point out of the directory after the check
    written = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
               "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "shutil.rmtree", "os.mkfifo", "os.mknod"}

    def hook(event, args):
        if event in refused:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes", "_posixsubprocess", "_socket"):
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode = real(args[0]), args[1] or "r"
            write = any(c in str(mode) for c in "wax+") or (isinstance(args[2], int) and args[2] & 0o3)
            if path is not None and not inside(path, [workdir] if write else readable):
                raise PermissionError(f"sandbox: opening {args[0]!r} is not allowed")
            if path is not None and os.path.isdir(path):  # a directory descriptor would allow dir_fd= paths
                raise PermissionError(f"sandbox: opening the directory {args[0]!r} is not allowed")
        elif event == "os.chdir":
            if real(args[0]) is None or not inside(real(args[0]), [workdir]):
                raise PermissionError(f"sandbox: changing directory to {args[0]!r} is not allowed")
        elif event in ("os.listdir", "os.scandir") and args[0] is not None:
            if real(args[0]) is not None and not inside(real(args[0]), readable):
                raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
        elif event in written or event == "os.rename":
            paths = args[:2] if event == "os.rename" else args[:1]
            for p in paths:
                if real(p) is not None and not inside(real(p), [workdir]):
                    raise PermissionError(f"sandbox: {event} on {p!r} is not allowed")

    sys.addaudithook(hook)

def _main():
    job = json.loads(sys.stdin.read())
    # The result goes to a file outside the working directory, opened before the lock-down; its size is capped by
    # RLIMIT_FSIZE whatever the code writes to it.
    report = os.open(job.pop("report"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    token, code, tests = job.pop("token"), job.pop("code"), job.pop("tests")
    _lock_down(job)
    namespace = {"__name__": "__main__"}
    error, passed = None, 0
    try:
        exec(compile(code, "<completion>", "exec"), namespace)
    except BaseException as e:
        error = f"the code raised {type(e).__name__}: {e}"[:500]
    if error is None:
        for test in tests:
            try:
                exec(compile(test, "<test>", "exec"), namespace)
                passed += 1
            except BaseException:
                pass
    os.write(report, (token + " " + json.dumps({"passed": passed, "error": error}) + "\n").encode())
    os._exit(0)

_main()
"""


def _stdlib_dirs() -> list[str]:
    import sysconfig

    paths = sysconfig.get_paths()
    return sorted({paths["stdlib"], paths["platstdlib"]})


def run_python(code: str, tests: list[str], limits: Limits | None = None) -> SandboxResult:
    """Run `code`, then each test (a snippet that raises, typically with `assert`, when it fails), in one
    restricted child process; count the tests that pass. Never raises for anything the code does."""
    limits = limits or Limits()
    token = secrets.token_hex(16)
    job = {
        "token": token,
        "code": code,
        "tests": list(tests),
        "cpu": max(1, int(limits.cpu_seconds)),
        "memory_mb": int(limits.memory_mb),
        "file_size_mb": int(limits.file_size_mb),
        "max_open_files": int(limits.max_open_files),
        "stdlib": _stdlib_dirs(),
    }
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    reportdir = tempfile.mkdtemp(prefix="grpo-sandbox-report-")
    job["report"] = os.path.join(reportdir, "result")
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _HARNESS],
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, killed as a whole below
            close_fds=True,
        )
        try:
            proc.communicate(json.dumps(job).encode(), timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            return SandboxResult(0, len(tests), f"timed out after {limits.wall_seconds} s")
        finally:
            _kill_group(proc)  # on timeout, and anything it left behind in its group
        for line in _tail(job["report"]).splitlines():
            if line.startswith(token + " "):
                report = json.loads(line[len(token) + 1 :])
                return SandboxResult(report["passed"], len(tests), report["error"])
        reason = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        return SandboxResult(0, len(tests), f"the process ended without a result ({reason})")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(reportdir, ignore_errors=True)


def _tail(path: str, size: int = 65536) -> str:
    """The end of the report file (the result line is written last)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
