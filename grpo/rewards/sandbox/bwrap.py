"""The bubblewrap command line of the "bwrap" isolation: new namespaces, a read-only view of the interpreter and its
standard library, a private tmpfs as the only writable place, and the seccomp filter given as a descriptor.
"""

from __future__ import annotations

import os
import sys
import sysconfig


def stdlib_dirs() -> list[str]:
    """The base interpreter's standard library (with lib-dynload), never a virtual environment's site-packages."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    paths = sysconfig.get_paths(
        vars={**base, "installed_base": sys.base_prefix, "installed_platbase": base["platbase"]}
    )
    return sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])})


def _read_only_paths() -> list[str]:
    """What the interpreter needs: its executable, its standard library, and the system's shared libraries."""
    wanted = [os.path.realpath(sys.executable), *stdlib_dirs(), "/usr/lib", "/usr/lib64"]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        for name in ("LDLIBRARY", "INSTSONAME"):
            if sysconfig.get_config_var(name):
                wanted.append(os.path.join(libdir, sysconfig.get_config_var(name)))
    wanted = sorted({os.path.realpath(p) for p in wanted if os.path.exists(p)})
    return [p for p in wanted if not any(p.startswith(q + os.sep) for q in wanted)]  # parents cover children


def bwrap_argv(disk_mb: int, seccomp_fd: int | None) -> list[str]:
    """bubblewrap's arguments up to the interpreter: the namespaces, the read-only mounts, a tmpfs of `disk_mb` at
    /tmp (the working directory) and the seccomp filter read from `seccomp_fd` (none when None)."""
    argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    # The harness's supervisor is pid 1, with no bwrap init process beside it: that init kept the trainer's pipes
    # (the job in, the output out) as its stdio, open to the code through /proc/1/fd. The supervisor holds them too,
    # but is not dumpable, so its /proc/1/fd is closed to the code.
    argv += ["--as-pid-1"]
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
    argv += ["--size", str(disk_mb * 1024 * 1024), "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--", os.path.realpath(sys.executable)]
