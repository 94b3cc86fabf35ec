"""Network helpers for tests that start servers or launch processes."""

import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stand_in_server(status: int = 200, answer: dict | None = None):
    """A stand-in HTTP server on 127.0.0.1 that answers every GET and POST with `status` and the JSON `answer`.
    Yields (base URL, the requests seen: a dict of method, path and lower-cased headers each)."""
    seen = []
    body = json.dumps(answer if answer is not None else {"status": "ok"}).encode()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(
                {"method": self.command, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
            )
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
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
