"""The agent <-> trainer channel on one host: JSON lines over a Unix socket.

Only small control messages travel here (round numbers, file paths, losses); tensors go
through safetensors files in shared memory. JSON rather than pickle: a trainer must not be able
to make the agent run code, nor the other way round.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_LINE = 1 << 20

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class IpcError(RuntimeError):
    """The other side answered with an error, or the channel broke."""


class _RequestHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_LINE)
            if not line:
                return
            try:
                request = json.loads(line)
                if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                    raise ValueError("a request is a JSON object with an 'op' string")
                reply = self.server.dispatch(request)  # type: ignore[attr-defined]
            except Exception as exc:  # the trainer gets the message; the agent keeps running
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.wfile.write(json.dumps(reply).encode() + b"\n")
            self.wfile.flush()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    allow_reuse_address = True


class IpcServer:
    """Serves ``handlers[op](request) -> reply`` on a Unix socket, one thread per client."""

    def __init__(self, path: Path, handlers: dict[str, Handler]) -> None:
        self.path = Path(path)
        self.path.unlink(missing_ok=True)
        self._server = _Server(str(self.path), _RequestHandler)
        self._server.dispatch = self._dispatch  # type: ignore[attr-defined]
        self.handlers = handlers
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agent-ipc", daemon=True
        )

    def _dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        handler = self.handlers.get(request["op"])
        if handler is None:
            raise ValueError(f"unknown op {request['op']!r}")
        return handler(request)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, so only if it runs
            self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


class IpcClient:
    """A trainer's connection to its agent."""

    def __init__(self, path: str | Path, timeout_s: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            raise IpcError(f"cannot reach the site agent at {path}: {exc}") from exc
        self.file = self.sock.makefile("rwb")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.file.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        self.file.flush()
        line = self.file.readline(MAX_LINE)
        if not line:
            raise IpcError(f"the site agent closed the connection during {op!r}")
        reply = json.loads(line)
        if "error" in reply:
            raise IpcError(f"{op}: {reply['error']}")
        return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()
