"""Network helpers for tests that start servers or launch processes."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TWO_CPU_PROCESSES = ROOT / "tests" / "configs" / "accelerate_cpu_2proc.yaml"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(
    *args, config=TWO_CPU_PROCESSES, cwd=ROOT, env=None, check=True
) -> subprocess.CompletedProcess:
    """Run `args` (a script and its arguments, or "-m", a module and its arguments) under `accelerate launch` with
    `config` (default: 2 CPU processes over gloo) and assert that it succeeded (unless `check` is False). `env` entries are added to the
    environment (None removes a variable). ACCELERATE_USE_CPU=1 by default: the launcher does not export the config
    file's use_cpu, and without it each process trains alone."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(config), "--main_process_port", str(free_port()), *map(str, args),
    ]  # fmt: skip
    variables = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "ACCELERATE_USE_CPU": "1",
        "PYTHONFAULTHANDLER": "1",  # a process killed by a signal prints every thread's Python stack
        **(env or {}),
    }
    variables = {key: value for key, value in variables.items() if value is not None}
    result = subprocess.run(command, cwd=cwd, env=variables, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 or not check, result.stderr[-3000:]
    return result


def end_launched_process() -> None:
    """The last call of a script that `launch_two_processes` starts, once its results are written: leave the process
    group, flush, and exit at once with status 0. Skipping the interpreter's teardown is deliberate: after a run
    that passed, a gloo process has been seen (rarely, in CI on 2 busy cores, not reproduced here in about 45 launches) to
    abort in that teardown with "terminate called without an active exception", failing a test whose results were
    already written. A failure before this call still exits non-zero, and PYTHONFAULTHANDLER (set by the launcher)
    prints every thread's Python stack if a signal kills the process."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # no process leaves while another still needs it
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def stand_in_server(
    status: int = 200, answer: dict | None = None, body: bytes | None = None, content_type: str = "application/json"
):
    """A stand-in HTTP server on 127.0.0.1 that answers every GET and POST with `status` and the JSON `answer` (or
    the raw `body`, sent as `content_type`). Yields (base URL, the requests seen: a dict of method, path and
    lower-cased headers each)."""
    seen = []
    if body is None:
        body = json.dumps(answer if answer is not None else {"status": "ok"}).encode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(
                {"method": self.command, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
            )
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
