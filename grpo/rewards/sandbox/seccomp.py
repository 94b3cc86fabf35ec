"""The sandbox's two seccomp filters, built with libseccomp through ctypes (so ctypes loads with the sandbox, once
code execution is asked for, never with `import grpo`): the sandbox's, which bubblewrap installs (`--seccomp`), and
the worker's, which the harness installs before the untrusted code runs. Without libseccomp.so.2 there is no
filter, with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import tempfile

logger = logging.getLogger(__name__)

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
# No signals and no tracing either, of any process: under isolation="process" the trainer's processes are in view
# (pidfd_open + pidfd_send_signal passed the audit hook), and the kernel, unlike the hook, cannot be walked around.
# The cost: the code cannot signal itself (signal.raise_signal, os.kill(os.getpid(), ...)) either.
_SECCOMP_WORKER_DENY = (
    "fork vfork execve execveat kill tkill tgkill rt_sigqueueinfo rt_tgsigqueueinfo pidfd_open pidfd_send_signal "
    "pidfd_getfd ptrace process_vm_readv process_vm_writev"
).split()
_CLONE_THREAD = 0x00010000


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


@functools.cache
def seccomp_programs() -> tuple[bytes, bytes] | None:
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
