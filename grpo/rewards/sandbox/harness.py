"""The program that runs inside the code sandbox (grpo/rewards/sandbox/__init__.py runs its source with
`python -I -S -B -c`, under bubblewrap or as a plain child process). It sees only the standard library: it must
never import grpo or anything installed.

Its first half, the supervisor (`supervise`), runs before any untrusted code: it ties its life to its parent's
(`die_with_parent`) and arms its own wall-clock timer (`arm_wall_timer`), both from its arguments, before it reads
anything; then it reads the job from stdin, holds the report pipe, forks the worker, and only then reads the random
token, so the worker's memory never holds it. When the timer fires the supervisor kills the worker's process group
and reports the timeout itself: no help from the trainer is needed, which may be stopped, busy or gone. The
worker (`work`) keeps no descriptor but its own pipe and the one its stdout and stderr go to, locks itself down
(rlimits, a seccomp filter against new processes, an audit hook) and then runs the code and the tests. The
supervisor accepts only a well-formed count in range (`verdict`) and writes it, with the token, to the report pipe;
what the code printed (its first `output_bytes`) it writes to its own stdout, apart from the verdict.

With test cases instead of tests (`job["cases"]`), the worker gets only each case's input (a call expression, or
the text for stdin) and sends back what each returned or printed, as plain data (`plain_problem`), never a verdict:
the expected values stay with the trainer, which compares (grpo/rewards/sandbox/cases.py).
"""

import json
import os
import signal
import sys
import time

# The supervisor's arguments after `-c SOURCE`: this marker, the pid its parent must have (0 under bubblewrap, whose
# new PID namespace shows no parent), the time.monotonic() by which the run must end, and the wall limit as the
# trainer writes it (for the error message).
MARKER = "grpo-sandbox"
# After the wall timer fires: how long the supervisor may take to reap the worker and write its report before it
# exits without one (a trainer that is stopped and never reads cannot hold it).
REPORT_GRACE = 0.5
# The supervisor's exit statuses of its own (the trainer reports them with stderr's last line).
PARENT_GONE, NO_DEATH_SIGNAL, TIMED_OUT_EARLY = 70, 71, 72
# The worker's pid and whether the wall timer has fired, for the timer's handler.
watch = {"worker": 0, "timed_out": False}


def die_with_parent(parent):
    # PR_SET_PDEATHSIG: the kernel sends SIGKILL when the parent (the thread that started this process) ends. Then
    # the race: a parent that ended before the prctl sent nothing, and this process was already reparented, which
    # getppid() shows. Linux only: without prctl the sandbox refuses to run rather than risk outliving the trainer.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        os.write(2, b"sandbox: prctl(PR_SET_PDEATHSIG) failed: the sandbox cannot tie its life to its parent's\n")
        os._exit(NO_DEATH_SIGNAL)
    if os.getppid() != parent:
        os._exit(PARENT_GONE)


def on_wall_limit(signum, frame):
    # SIGALRM, in the supervisor: the first time, kill the worker's process group (the worker ends, its pipes close,
    # and the supervisor reports the timeout); the second time, REPORT_GRACE later, exit without a report. Before
    # the worker exists there is nothing to report: exit at once.
    if watch["timed_out"] or not watch["worker"]:
        why = b"its report could not be written" if watch["timed_out"] else b"the code could start"
        os.write(2, b"sandbox: the wall-clock limit passed before " + why + b"\n")
        os._exit(TIMED_OUT_EARLY)
    watch["timed_out"] = True
    try:
        os.killpg(watch["worker"], signal.SIGKILL)
    except OSError:  # already gone
        pass
    signal.setitimer(signal.ITIMER_REAL, REPORT_GRACE)


def arm_wall_timer(deadline, wall):
    # The run's deadline is the trainer's time.monotonic() at the start plus the wall limit (one clock for every
    # process of the machine), so start-up counts; never more than the wall limit from now.
    signal.signal(signal.SIGALRM, on_wall_limit)
    left = min(wall, deadline - time.monotonic())
    if left <= 0:
        os._exit(TIMED_OUT_EARLY)
    signal.setitimer(signal.ITIMER_REAL, left)


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


# Audit events the hook refuses outright: sockets, new processes, signals, ctypes, reaching other objects or frames,
# raising the rlimits, links.
REFUSED_EVENTS = frozenset(
    (
        "socket.__new__ socket.connect socket.bind socket.getaddrinfo socket.gethostbyname os.fork os.forkpty "
        "os.system os.exec os.posix_spawn os.spawn subprocess.Popen os.kill os.killpg signal.pthread_kill "
        "ctypes.dlopen ctypes.dlsym ctypes.cdata ctypes.call_function gc.get_objects gc.get_referrers "
        "gc.get_referents os.chroot sys._current_frames resource.setrlimit resource.prlimit os.symlink os.link"
    ).split()
)
# Audit events that change the file system: allowed on paths inside the working directory only.
WRITE_EVENTS = frozenset(
    (
        "os.remove os.rmdir os.mkdir os.chmod os.chown os.truncate os.utime os.chflags os.lchflags os.setxattr "
        "os.removexattr shutil.rmtree os.mkfifo os.mknod"
    ).split()
)


def path_functions():
    # The functions the hook calls, taken now: code that replaces os.path.realpath, os.path.isdir or os.stat (known
    # ways round this hook) changes the modules' names, not these. What realpath calls in turn is still looked up
    # when it runs: the hook is a layer, not a wall. Returns (realpath, real, isdir).
    import stat

    realpath, fspath, fsdecode, os_stat, is_dir_mode = os.path.realpath, os.fspath, os.fsdecode, os.stat, stat.S_ISDIR

    def isdir(path):
        try:
            return is_dir_mode(os_stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def real(path):
        if isinstance(path, int):  # an already open descriptor
            return None
        if isinstance(path, bytes):
            path = fsdecode(path)
        return realpath(fspath(path))

    return realpath, real, isdir


def install_hook(job):
    # Everything the hook uses is bound here, in its closure: the code can rebind this module's names (it is
    # __main__), not these.
    realpath, real, isdir = path_functions()
    refused, written = REFUSED_EVENTS, WRITE_EVENTS
    workdir = realpath(os.getcwd())
    readable = [workdir] + [realpath(p) for p in job["stdlib"]]

    def inside(path, roots):
        return any(path == r or path.startswith(r + os.sep) for r in roots)

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
            if path is not None and isdir(path):  # a directory descriptor would allow dir_fd= paths
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


def work(job, out, printed):
    # The worker: locked down first, then the untrusted code; its report goes to the supervisor through `out`.
    lock_down(job, out, printed)
    try:  # each line reaches the pipe when printed, so stdout and stderr interleave as they were written
        sys.stdout.reconfigure(line_buffering=True)
    except Exception:
        pass
    import builtins

    # exit() and quit(), which programs call and `site` adds (this interpreter runs with -S)
    builtins.exit = builtins.quit = sys.exit
    report = run_code(job)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:  # os._exit below skips the interpreter's own flush
            stream.flush()
        except BaseException:
            pass
    write_all(out, json.dumps(report).encode())
    os._exit(0)


def lock_down(job, out, printed):
    # Before any untrusted code: stdin /dev/null, stdout and stderr the supervisor's `printed` pipe, its own pipe to
    # the supervisor (`out`) and no other descriptor; then the rlimits, the seccomp filter and the audit hook.
    # Its own process group, which the supervisor's wall timer kills whole; dead with the supervisor (checked
    # against the race where the supervisor ended first); SIGALRM back to its default (the handler is the
    # supervisor's).
    os.setpgid(0, 0)
    die_with_parent(job["supervisor"])
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(printed, 1)
    os.dup2(printed, 2)
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

            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET, where allowed (root, user ns)
        except Exception:
            pass
    set_limits(limits)
    if job["worker_seccomp"]:
        no_new_processes(bytes.fromhex(job["worker_seccomp"]))
    if job["hook"]:
        install_hook(job)


def run_code(job):
    # The code, then the tests (counting those that pass) or the cases (what each returned or printed); returns the
    # report: {"passed", "error"}, or with cases {"results", "error"}.
    namespace = {"__name__": "__main__"}
    cases, error, passed, results = job["cases"], None, 0, None
    try:
        program = compile(job["code"], "<completion>", "exec")
        if not (cases and "stdin" in cases[0]):  # a program-style case runs the code itself, once per input
            exec(program, namespace)
    except BaseException as e:
        error = f"the code raised {type(e).__name__}: {e}"[:500]
    if error is None and cases is not None:
        if cases and "stdin" in cases[0]:
            results = run_programs(program, cases, job["result_bytes"], job["file_size_mb"] * 1024 * 1024)
        else:
            results = evaluate_calls(namespace, cases, job["result_bytes"])
    elif error is None:
        for test in job["tests"]:
            try:
                exec(compile(test, "<test>", "exec"), namespace)
                passed += 1
            except BaseException:
                pass
    return {"passed": passed, "error": error} if cases is None else {"results": results, "error": error}


def plain_problem(value, depth=0):
    """None when `value` is plain data: None, a bool, int, float or str, or a list, tuple or dict (string keys) of
    plain data, nested at most 100 deep; else what is not. Types are checked exactly: a subclass (an int with its
    own `__eq__`) is not plain data. The worker sends only plain data, and the trainer accepts only plain data."""
    kind = type(value)
    if kind in (type(None), bool, int, float, str):
        return None
    if depth >= 100:
        return "data nested more than 100 deep"
    if kind in (list, tuple):
        for item in value:
            problem = plain_problem(item, depth + 1)
            if problem:
                return problem
        return None
    if kind is dict:
        for key, item in value.items():
            problem = f"a dict with a key of type {type(key).__name__}" if type(key) is not str else None
            problem = problem or plain_problem(item, depth + 1)
            if problem:
                return problem
        return None
    return f"an object of type {kind.__name__}, not plain data (None, bool, int, float, str, list, dict)"


def well_formed_results(results, count):
    """Whether `results` (as read from JSON) is one entry per case: [true, value] with plain data, or [false, why]
    with a string. The supervisor checks what the worker sent with it, and the trainer checks the report again."""
    if type(results) is not list or len(results) != count:
        return False
    for item in results:
        if type(item) is not list or len(item) != 2 or type(item[0]) is not bool:
            return False
        if plain_problem(item[1]) if item[0] else type(item[1]) is not str:
            return False
    return True


# The entry of a case whose result did not fit in what was left of the results' bytes (what any entry may take).
TOO_LARGE = [False, "its result is over the size limit for results"]
ENTRY_BYTES = 64


def entry(ok, value, budget):
    # One case's entry, [True, what it returned or printed] or [False, why], charged to budget[0], the bytes left for
    # results: past them, or when the value is not plain data JSON can hold, the case failed.
    problem = plain_problem(value) if ok else None
    if problem:
        ok, value = False, f"returned {problem}"
    try:
        size = len(json.dumps([ok, value]))
    except (ValueError, RecursionError) as e:  # e.g. an int with more digits than int-to-str allows
        ok, value, size = False, f"returned a value JSON cannot hold ({type(e).__name__})", ENTRY_BYTES
    if size > budget[0]:
        return TOO_LARGE
    budget[0] -= size
    return [ok, value]


def evaluate_calls(namespace, cases, result_bytes):
    # Each case's call expression, evaluated in the code's namespace; what it returned is sent back as plain data.
    results, budget = [], [result_bytes]
    for case in cases:
        try:
            value = eval(compile(case["call"], "<case>", "eval"), namespace)
        except BaseException as e:
            results.append(entry(False, f"raised {type(e).__name__}: {e}"[:300], budget))
            continue
        results.append(entry(True, value, budget))
    return results


def stdin_of(text, file_size):
    # The case's input as sys.stdin, and as descriptor 0 too (a memory file), so that open(0) and os.read(0, ...)
    # read it as well; an input past RLIMIT_FSIZE (`file_size`), which a memory file cannot hold, is sys.stdin only.
    import io

    data = text.encode()
    if len(data) < file_size and hasattr(os, "memfd_create"):
        fd = os.memfd_create("stdin")  # 0 itself when the last case's program closed it (open(0) does)
        write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        if fd != 0:
            os.dup2(fd, 0)
            os.close(fd)
        return io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def run_programs(program, cases, result_bytes, file_size):
    # The code as a program, once per case: stdin is the case's text, and what it prints to sys.stdout is sent back.
    import io

    class Capture(io.RawIOBase):  # keeps at most `limit` bytes; past that, writing fails
        def __init__(self, limit):
            self.data, self.limit = bytearray(), limit

        def writable(self):
            return True

        def write(self, data):
            if len(self.data) + len(data) > self.limit:
                raise OSError(f"printed more than the {self.limit} bytes left for results")
            self.data += data
            return len(data)

    results, budget, saved = [], [result_bytes], (sys.stdin, sys.stdout)
    for case in cases:
        captured = Capture(budget[0])
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(captured), encoding="utf-8", errors="replace")
        why = None
        try:  # the last case's program may have closed or replaced descriptor 0: that fails this case, no more
            sys.stdin = stdin_of(case["stdin"], file_size)
            exec(program, {"__name__": "__main__"})
        except SystemExit as e:  # exit() and exit(0) end a program normally
            if e.code not in (None, 0):
                why = f"exited with status {e.code!r}"[:300]
        except BaseException as e:
            why = f"raised {type(e).__name__}: {e}"[:300]
        try:
            sys.stdout.flush()
        except BaseException as e:
            why = why or f"raised {type(e).__name__}: {e}"[:300]
        sys.stdin, sys.stdout = saved
        printed = captured.data.decode("utf-8", "replace")
        captured.limit = float("inf")  # a flush when the stream is collected must not raise again
        results.append(entry(False, why, budget) if why else entry(True, printed, budget))
    return results


def results_bytes(job):
    # The most the case results may take as JSON: the values' budget, and the few bytes of each entry around it.
    return job["result_bytes"] + ENTRY_BYTES * len(job["cases"] or ())


def verdict(data, status, job):
    # Everything the worker sent is untrusted: accept only a well-formed count in range, or with cases, one
    # well-formed entry per case (and no more than result_bytes of them). Returns (passed, error, results).
    cases = job["cases"]
    if watch["timed_out"]:
        return 0, f"timed out after {job['wall']} s", None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {24: f"exceeded the CPU limit of {job['cpu']} s", 25: "exceeded the file size limit"}.get(sig)
        return 0, why or f"killed by signal {sig}", None
    try:
        report = json.loads(data.decode())
        error = report["error"]
        if not (error is None or type(error) is str):
            raise ValueError
        if error is not None:
            return 0, error[:500], None
        if cases is not None:
            results = report["results"]
            if not well_formed_results(results, len(cases)) or len(json.dumps(results)) > results_bytes(job):
                raise ValueError
            return 0, None, results
        passed = report["passed"]
        if type(passed) is not int or not 0 <= passed <= len(job["tests"]):
            raise ValueError
        return passed, None, None
    except Exception:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
        return 0, f"the process ended without a valid result (exit status {code})", None


def supervise():
    # Before anything is read: dead with the trainer, and a timer for the wall limit.
    marker, parent, deadline, wall = sys.argv[1:5]
    if marker != MARKER:
        os._exit(2)
    die_with_parent(int(parent))
    arm_wall_timer(float(deadline), float(wall))
    header = b""
    while not header.endswith(b"\n"):
        header += read_exactly(0, 1)
    job = json.loads(read_exactly(0, int(header)))
    job["wall"], job["supervisor"] = wall, os.getpid()
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
    printed_r, printed_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(printed_r)
        work(job, w, printed_w)
    watch["worker"] = pid
    try:  # here too, so that the group exists before the timer may kill it (the worker's own call may come later)
        os.setpgid(pid, pid)
    except OSError:
        pass
    os.close(w)
    os.close(printed_w)
    del job["code"]
    token = read_exactly(0, 32)  # only now: the worker's memory never held it
    data, printed, printed_bytes = collect(r, printed_r, job["output_bytes"], results_bytes(job) + 4096)
    _, status = os.waitpid(pid, 0)
    passed, error, results = verdict(data, status, job)
    # What the code printed is no part of the verdict: it goes to stdout, the report keeps only its size.
    result = {"passed": passed, "error": error, "output_bytes": printed_bytes, "results": results}
    try:  # a trainer that is gone closed the pipes (EPIPE); one that never reads is cut off by the timer's second call
        write_all(1, printed)
        write_all(report, token + b" " + json.dumps(result).encode() + b"\n")
    except OSError:
        pass
    os._exit(0)


def collect(result_fd, printed_fd, limit, result_limit):
    # Read the worker's result and what it prints until both pipes close, draining both at once so that a worker
    # printing without end never blocks on a full pipe. Keeps `result_limit` bytes of result (more is cut, so no
    # longer valid), `limit` bytes of output, and the count of every byte printed.
    import select

    data, printed, printed_bytes, pending = b"", b"", 0, [result_fd, printed_fd]
    while pending:
        for fd in select.select(pending, [], [])[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                pending.remove(fd)
            elif fd == result_fd:
                data += chunk[: max(0, result_limit + 1 - len(data))]
            else:
                printed_bytes += len(chunk)
                printed += chunk[: max(0, limit - len(printed))]
    return data, printed, printed_bytes


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


if __name__ == "__main__":
    supervise()
