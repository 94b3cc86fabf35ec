"""The API key of `grpo vllm-serve`, and how a trainer of the same user on the same machine finds it (docs/vllm.md#security).

A server requires a key unless it is started with `--insecure-no-key`: the one it is given (`--api-key`, or the
GRPO_VLLM_API_KEY environment variable), or else a random one it makes, prints, and writes to a key file that only
its user can read:

    ~/.cache/grpo/vllm-serve-PORT.key      (the file 0600, its folder 0700 when created here)

A client (grpo/generation/vllm/client.py) given no key and no GRPO_VLLM_API_KEY reads that file when it connects to
a loopback address: the same user needs no setup, while another user of the machine, who can reach a loopback port
just as well, cannot read the file. A client on another machine gets the key the server printed through
GRPO_VLLM_API_KEY.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

API_KEY_ENV = "GRPO_VLLM_API_KEY"


def is_loopback(host: str | None) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name (or None): it may resolve to any interface
        return False


def key_file(port: int) -> Path:
    """Where a server on `port` that made its own key keeps it (under the user's home folder)."""
    return Path.home() / ".cache" / "grpo" / f"vllm-serve-{port}.key"


def write_key_file(port: int, key: str) -> Path:
    """Write `key` to `key_file(port)`, readable by this user only, replacing a file a dead server left behind.
    Written under another name and renamed, so a client never reads half a key."""
    path = key_file(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that was already there
        os.write(fd, key.encode())
    finally:
        os.close(fd)
    os.replace(partial, path)
    return path


def read_key_file(port: int) -> str | None:
    """The key a server on `port` wrote on this machine for this user, or None."""
    try:
        return key_file(port).read_text().strip() or None
    except OSError:
        return None


def remove_key_file(port: int, key: str) -> None:
    """Remove the key file if it still holds `key` (a newer server on the same port may have replaced it)."""
    if read_key_file(port) == key:
        key_file(port).unlink(missing_ok=True)
