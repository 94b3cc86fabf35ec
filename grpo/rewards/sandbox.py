"""Running untrusted code (a model's completion) against tests, contained by the operating system.

    result = run_python("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"], Limits(wall_seconds=5))
    result.passed, result.total, result.error      # 1, 1, None

Isolation (`isolation=`, default "bwrap"; the threat model and its limits are in docs/rewards.md):
  - "bwrap": the child runs under bubblewrap (`apt-get install bubblewrap`) in new user, PID, mount, network, IPC,
    UTS and cgroup namespaces, as uid 65534 with every capability dropped, nested user namespaces disabled, in its
    own session, and dies with the trainer (`--die-with-parent`). Its file system is read-only and holds only the
    interpreter, its standard library and /usr/lib (no /etc, no home, no project files); a private tmpfs of
    `disk_mb` at /tmp is its working directory and the only writable place. /proc is that of its own PID namespace:
    no process outside the sandbox can be seen, signalled or traced. The network namespace has only its own
    loopback. A seccomp filter (built with libseccomp through ctypes, when libseccomp.so.2 is installed) refuses
    ptrace, other processes' memory, mounts, namespaces, keyrings, bpf, perf, io_uring, userfaultfd, modules and
    every socket but AF_UNIX. If bwrap is missing or cannot start here, `run_python` raises `SandboxUnavailable`.
  - "process": the weaker mode, used only when asked for by name: a plain child process as the trainer's user, with
    the same limits, worker filter and audit hook, a throwaway working directory, and a network namespace only where
    the kernel allows one. It does not stop the code from reaching the trainer's files or processes through ctypes.

In both modes the process that runs the code (the worker) has rlimits (CPU seconds, address space, file size, open
files; processes in "bwrap"), a second seccomp filter that refuses fork, clone of a process and exec (threads
stay allowed), and a `sys.addaudithook` hook that refuses sockets, new processes, signals, ctypes and files outside
the working directory. The hook is an extra layer only: Python code can walk around it, the layers above it not.

The reported result is validated twice. Inside the sandbox a supervisor process reads the job, forks the worker,
and only then reads a random token, so the worker's memory never holds it. The worker closes the report pipe (the
supervisor is not dumpable and ptrace is filtered, so it cannot reopen it) and sends its count through a pipe of
its own; the supervisor accepts only a well-formed count with 0 <= passed <= total and writes it, with the token,
to the report pipe, where the trainer checks the token, the format and the range again. Exiting early, printing
results, writing to inherited descriptors or claiming more passes than tests gives no pass. What no sandbox can
prevent: the worker runs the tests, so code that subverts them in its own process (an `__eq__` that is always
True, or a forged count on its own pipe) can score up to `total`, never more.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "process")


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


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot run on this machine (the message says how to fix it)."""


# The program run inside the sandbox. Its top half (the supervisor) runs before any untrusted code and holds the
# report pipe; the worker it forks drops that pipe, locks itself down and then runs the code and the tests.
_HARNESS = r"""
import json, os, sys

def read_exactly(fd, n):
    chunks = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("job truncated")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)

def set_limits(pairs):
    import resource
    for name, soft, hard in pairs:
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError):
            pass

def install_hook(job):
    workdir = os.path.realpath(os.getcwd())
    readable = [workdir] + [os.path.realpath(p) for p in job["stdlib"]]
    inside = lambda path, roots: any(path == r or path.startswith(r + os.sep) for r in roots)

    def real(path):
        if isinstance(path, int):  # an already open descriptor
            return None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return os.path.realpath(os.fspath(path))

    refused = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
               "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
               "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
               "ctypes.call_function", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "os.chroot",
               "sys._current_frames", "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link"}
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
            for p in args[:2] if event == "os.rename" else args[:1]:
                if real(p) is not None and not inside(real(p), [workdir]):
                    raise PermissionError(f"sandbox: {event} on {p!r} is not allowed")

    for name in ("ctypes", "_ctypes"):
        sys.modules.pop(name, None)
    sys.addaudithook(hook)

def no_new_processes(program):
    # The kernel refuses fork, vfork, clone of a process and exec from here on: a fork bomb cannot start.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    class Program(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    code = ctypes.create_string_buffer(program, len(program))
    fprog = Program(len(program) // 8, ctypes.addressof(code))
    # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "installing the worker's seccomp filter failed")

def work(job, out):
    # The worker: no descriptor but /dev/null and its own pipe to the supervisor, then the untrusted code.
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, out)
    os.closerange(out + 1, 1 << 16)
    mb = 1024 * 1024
    limits = [("RLIMIT_CPU", job["cpu"], job["cpu"] + 1), ("RLIMIT_AS", job["memory_mb"] * mb, job["memory_mb"] * mb)]
    if job["isolation"] == "process":
        if not job["worker_seccomp"]:
            # RLIMIT_NPROC counts every process of the trainer's user here: 0 refuses new ones (and threads; root
            # is exempt). With the seccomp filter below, forks are refused by the kernel instead.
            limits.append(("RLIMIT_NPROC", 0, 0))
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: dies with the supervisor even after leaving its group
            libc.unshare(0x40000000)  # CLONE_NEWNET, where the kernel allows it (root, or user namespaces)
        except Exception:
            pass
    set_limits(limits)
    if job["worker_seccomp"]:
        no_new_processes(bytes.fromhex(job["worker_seccomp"]))
    if job["hook"]:
        install_hook(job)
    namespace = {"__name__": "__main__"}
    error, passed = None, 0
    try:
        exec(compile(job["code"], "<completion>", "exec"), namespace)
    except BaseException as e:
        error = f"the code raised {type(e).__name__}: {e}"[:500]
    if error is None:
        for test in job["tests"]:
            try:
                exec(compile(test, "<test>", "exec"), namespace)
                passed += 1
            except BaseException:
                pass
    os.write(out, json.dumps({"passed": passed, "error": error}).encode())
    os._exit(0)

def verdict(data, status, job):
    # Everything the worker sent is untrusted: accept only a well-formed count in range.
    total = len(job["tests"])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {24: f"exceeded the CPU limit of {job['cpu']} s", 25: "exceeded the file size limit"}.get(sig)
        return 0, why or f"killed by signal {sig}"
    try:
        report = json.loads(data.decode())
        passed, error = report["passed"], report["error"]
        if type(passed) is not int or not 0 <= passed <= total or not (error is None or type(error) is str):
            raise ValueError
        return passed, None if error is None else error[:500]
    except Exception:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
        return 0, f"the process ended without a valid result (exit status {code})"

def supervise():
    header = b""
    while not header.endswith(b"\n"):
        header += read_exactly(0, 1)
    job = json.loads(read_exactly(0, int(header)))
    report = job["report_fd"]
    mb = 1024 * 1024
    limits = [("RLIMIT_FSIZE", job["file_size_mb"] * mb), ("RLIMIT_NOFILE", job["max_open_files"]), ("RLIMIT_CORE", 0)]
    if job["nproc"]:  # counted in the sandbox's own user namespace, so other sandboxes do not add to it
        limits.append(("RLIMIT_NPROC", job["nproc"]))
    set_limits([(name, value, value) for name, value in limits])
    try:  # not dumpable, before the fork: the worker can never open /proc/<supervisor>/fd/<report> or attach to it
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        work(job, w)
    os.close(w)
    del job["code"]
    token = read_exactly(0, 32)  # only now: the worker's memory never held it
    data = b""
    while len(data) < 65536:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    _, status = os.waitpid(pid, 0)
    passed, error = verdict(data, status, job)
    os.write(report, token + b" " + json.dumps({"passed": passed, "error": error}).encode() + b"\n")
    os._exit(0)

supervise()
"""

# Refused inside the bwrap sandbox with EPERM: ways to reach other processes, the kernel's rarer attack surface,
# and namespace or mount tricks that the dropped capabilities already forbid (kept here as a second lock).
_SECCOMP_DENY = (
    "ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd mount umount2 pivot_root chroot move_mount "
    "open_tree fsopen fsconfig fsmount fspick mount_setattr unshare setns keyctl add_key request_key bpf "
    "perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register init_module finit_module "
    "delete_module kexec_load kexec_file_load reboot swapon swapoff acct syslog quotactl open_by_handle_at "
    "name_to_handle_at lookup_dcookie fanotify_init vhangup uselib ioperm iopl settimeofday clock_settime "
    "clock_adjtime adjtimex sethostname setdomainname mbind migrate_pages move_pages set_mempolicy"
).split()


# The worker's own, second filter: no new processes (fork, vfork, clone without CLONE_THREAD) and no exec; threads
# stay allowed. clone3 gets ENOSYS so that the C library falls back to clone, whose flags a filter can read.
_SECCOMP_WORKER_DENY = ("fork", "vfork", "execve", "execveat")
_CLONE_THREAD = 0x00010000


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


@functools.cache
def _seccomp_programs() -> tuple[bytes, bytes] | None:
    """Two seccomp BPF programs, built with libseccomp through ctypes: the sandbox's (for bwrap's `--seccomp`) and
    the worker's (installed by the harness before the code runs); None, with a warning, without libseccomp."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as e:
        logger.warning("No seccomp filter in the code sandbox: libseccomp.so.2 is not installed (%s).", e)
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_rule_add_array.argtypes += [ctypes.c_void_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(...)

    def build(rules):  # rules: (action, syscall name, argument comparison or None)
        ctx = lib.seccomp_init(allow)
        try:
            for action, name, cmp in rules:
                number = lib.seccomp_syscall_resolve_name(name.encode())
                if number < 0:  # not a system call on this architecture
                    continue
                arg = ctypes.byref(cmp) if cmp is not None else None
                if lib.seccomp_rule_add_array(ctx, action, number, int(cmp is not None), arg) != 0:
                    raise OSError(f"seccomp_rule_add({name}) failed")
            with tempfile.TemporaryFile() as f:
                if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                    raise OSError("seccomp_export_bpf failed")
                f.seek(0)
                return f.read()
        finally:
            lib.seccomp_release(ctx)

    not_unix = _ArgCmp(0, 1, 1, 0)  # SCMP_A0(SCMP_CMP_NE, AF_UNIX)
    not_a_thread = _ArgCmp(0, 7, _CLONE_THREAD, 0)  # SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0)
    sandbox_rules = [(eperm, name, None) for name in _SECCOMP_DENY] + [(eperm, "socket", not_unix)]
    worker_rules = [(eperm, name, None) for name in _SECCOMP_WORKER_DENY]
    worker_rules += [(eperm, "clone", not_a_thread), (enosys, "clone3", None)]
    try:
        return build(sandbox_rules), build(worker_rules)
    except OSError as e:
        logger.warning("No seccomp filter in the code sandbox: %s.", e)
        return None


def _stdlib_dirs() -> list[str]:
    """The base interpreter's standard library (with lib-dynload), never a virtual environment's site-packages."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(
        vars={**base, "installed_base": sys.base_prefix, "installed_platbase": base["platbase"]}
    )
    return sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])})


def _read_only_paths() -> list[str]:
    """What the interpreter needs: its executable, its standard library, and the system's shared libraries."""
    wanted = [os.path.realpath(sys.executable), *_stdlib_dirs(), "/usr/lib", "/usr/lib64"]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        for name in ("LDLIBRARY", "INSTSONAME"):
            if sysconfig.get_config_var(name):
                wanted.append(os.path.join(libdir, sysconfig.get_config_var(name)))
    wanted = sorted({os.path.realpath(p) for p in wanted if os.path.exists(p)})
    return [p for p in wanted if not any(p.startswith(q + os.sep) for q in wanted)]  # parents cover children


def _bwrap_argv(limits: Limits, seccomp_fd: int | None) -> list[str]:
    argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += ["--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--clearenv"]
    for name, value in (("PATH", "/usr/bin:/bin"), ("LANG", "C.UTF-8"), ("HOME", "/tmp"), ("TMPDIR", "/tmp")):
        argv += ["--setenv", name, value]
    for path in _read_only_paths():
        argv += ["--ro-bind", path, path]
    for link in ("/lib", "/lib64"):  # the dynamic loader's path goes through these (links to /usr where merged)
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--size", str(limits.disk_mb * 1024 * 1024), "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--", os.path.realpath(sys.executable)]


def run_python(
    code: str, tests: list[str], limits: Limits | None = None, *, isolation: str = "bwrap", audit_hook: bool = True
) -> SandboxResult:
    """Run `code`, then each test (a snippet that raises, typically with `assert`, when it fails), in one sandboxed
    child process; count the tests that pass. Never raises for anything the code does; raises
    `SandboxUnavailable` when the isolation asked for cannot run here. `audit_hook=False` leaves out the
    Python-level layer (the tests use it to check that the OS layers hold on their own)."""
    check_isolation(isolation)
    return _run(code, list(tests), limits or Limits(), isolation, audit_hook)


def check_isolation(isolation: str = "bwrap") -> None:
    """Raise `SandboxUnavailable`, saying how to fix it, when `isolation` cannot run on this machine."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r}: use one of {ISOLATIONS}.")
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


def _run(code: str, tests: list[str], limits: Limits, isolation: str, audit_hook: bool) -> SandboxResult:
    total = len(tests)
    report_r, report_w = os.pipe()
    job = {
        "code": code,
        "tests": tests,
        "cpu": max(1, int(limits.cpu_seconds)),
        "memory_mb": int(limits.memory_mb),
        "file_size_mb": int(limits.file_size_mb),
        "max_open_files": int(limits.max_open_files),
        "nproc": int(limits.max_processes) if isolation == "bwrap" else 0,
        "stdlib": _stdlib_dirs(),
        "report_fd": report_w,
        "hook": audit_hook,
        "isolation": isolation,
    }
    programs = _seccomp_programs()
    job["worker_seccomp"] = programs[1].hex() if programs is not None else None
    token = secrets.token_hex(16)
    payload = json.dumps(job).encode()
    payload = str(len(payload)).encode() + b"\n" + payload + token.encode()
    fds, workdir, seccomp_fd = [report_w], None, None
    interpreter = [sys.executable, "-I", "-S", "-B", "-c", _HARNESS]
    if isolation == "bwrap":
        if programs is not None:
            seccomp_fd = os.memfd_create("grpo-seccomp", 0)
            os.write(seccomp_fd, programs[0])
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            fds.append(seccomp_fd)
        argv, cwd, env = _bwrap_argv(limits, seccomp_fd) + interpreter[1:], "/", {"PATH": os.environ.get("PATH", "")}
    else:
        workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
        argv, cwd = interpreter, workdir
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,  # bwrap's and the supervisor's messages only: the worker's go to /dev/null
            pass_fds=fds,
            start_new_session=True,  # its own process group, killed as a whole below
        )
        os.close(report_w)
        report_w = None
        try:
            _, stderr = proc.communicate(payload, timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            return SandboxResult(0, total, f"timed out after {limits.wall_seconds} s")
        finally:
            _kill_group(proc)
        parsed = _parse_report(_drain(report_r), token, total)
        if parsed is not None:
            return SandboxResult(*parsed)
        reason = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        detail = stderr.decode(errors="replace").strip()[-500:]
        return SandboxResult(
            0, total, f"the sandbox ended without a result ({reason}){': ' + detail if detail else ''}"
        )
    finally:
        for fd in (report_r, report_w, seccomp_fd):
            if fd is not None:
                os.close(fd)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _drain(fd: int, limit: int = 4096) -> bytes:
    """What the supervisor wrote to the report pipe (everything in the sandbox is dead by now)."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < limit:
            chunk = os.read(fd, limit)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    return data


def _parse_report(data: bytes, token: str, total: int) -> tuple[int, int, str | None] | None:
    """(passed, total, error) from the report line, or None unless it is exactly one well-formed line with the
    token and 0 <= passed <= total."""
    prefix = token.encode() + b" "
    if not data.startswith(prefix) or data.count(b"\n") != 1 or not data.endswith(b"\n"):
        return None
    try:
        report = json.loads(data[len(prefix) :].decode())
        passed, error = report["passed"], report["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if type(passed) is not int or not (error is None or isinstance(error, str)):
        return None
    return min(max(passed, 0), total), total, error if error is None else error[:500]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap's sandbox dies with it (--die-with-parent)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
