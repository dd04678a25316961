"""The coordinator's live status page: ``coordinator serve --status-page [HOST:]PORT``.

One HTML page (everything inline: no external script, style or font) that polls two JSON
documents: ``/status.json``, the ``coordinator status --json`` document, and
``/history.json``, the per-round rows of ``coordinator history`` (``page_history``). It is
read-only: GET and HEAD are answered, every other method is 405, and no route changes
anything. ``respond`` (pure, given the two documents' sources) decides every answer; the
handler around it only checks the reader (``page_access``) and writes bytes.

The standard library's threaded HTTP server is enough, and adds no dependency: three fixed
routes, no forms, no sessions, a few readers. It is its own port, not the metrics server's,
because its readers are checked differently: Prometheus scrapes plain HTTP, while the page
off loopback asks for an operator certificate.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from coordinator.observe.page_access import (
    INSECURE_FLAG,
    PageAccess,
    host_header_ok,
    operator_problem,
    server_context,
)
from coordinator.observe.page_history import LogFollower, history_doc
from coordinator.observe.status import StatusSnapshot, status_doc, status_reply
from coordinator.persist.local_store import write_atomic
from coordinator.service.auth import Authorizer, RevocationList
from wire.identity import Bundle

log = logging.getLogger("isthmus.coordinator")
SNAPSHOT_MAX_AGE_S = 0.5  # many open tabs take the coordinator's lock twice a second at most
MAX_CONNECTIONS = 32
PAGE = resources.files("coordinator.observe").joinpath("status_page.html").read_bytes()


@dataclass(frozen=True)
class Reply:
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PageSources:
    """Where the two documents come from (each a callable returning plain data)."""

    status: Callable[[], dict]
    history: Callable[[], dict]


def content_policy(page: bytes) -> str:
    """A Content-Security-Policy allowing exactly the page's own inline script and style (by
    hash), requests to its own origin, and nothing else."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag, tag), page, re.S)
        return " ".join(
            f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks
        )

    return (
        f"default-src 'none'; script-src {hashes(b'script')}; style-src {hashes(b'style')}; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


HTML_HEADERS = (("Content-Security-Policy", content_policy(PAGE)),)


def respond(method: str, target: str, sources: PageSources) -> Reply:
    """The answer to ``method target`` (HEAD: as GET; the handler drops the body)."""
    if method not in ("GET", "HEAD"):
        return _text(
            405, "the status page is read-only: only GET and HEAD", (("Allow", "GET, HEAD"),)
        )
    path = urlsplit(target).path
    if path in ("/", "/index.html"):
        return Reply(200, "text/html; charset=utf-8", PAGE, HTML_HEADERS)
    if path == "/status.json":
        return _json(sources.status())
    if path == "/history.json":
        return _json(sources.history())
    return _text(404, f"no page {path[:80]!r} here: try /, /status.json or /history.json")


def _text(status: int, message: str, headers: tuple = ()) -> Reply:
    return Reply(status, "text/plain; charset=utf-8", f"{message}\n".encode(), headers)


def _json(doc) -> Reply:
    body = json.dumps(finite(doc), sort_keys=True, allow_nan=False).encode()
    return Reply(200, "application/json", body)


def finite(doc):
    """``doc`` with every NaN or infinity made None (JSON has neither; a diverged site's loss
    must not break the page)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [finite(v) for v in doc]
    return doc


class SnapshotCache:
    """``coordinator status``'s document, built from a snapshot at most ``max_age_s`` old: the
    coordinator's lock is held only while the snapshot is read, never while a reply is sent."""

    def __init__(self, snapshot: Callable[[], StatusSnapshot], max_age_s: float) -> None:
        self.snapshot, self.max_age_s = snapshot, max_age_s
        self._lock = threading.Lock()
        self._doc: dict | None = None
        self._at = 0.0

    def __call__(self) -> dict:
        with self._lock:
            now = time.monotonic()
            if self._doc is None or now - self._at > self.max_age_s:
                self._doc, self._at = status_doc(status_reply(self.snapshot())), now
            return self._doc


class _Handler(BaseHTTPRequestHandler):
    server: StatusPageServer
    protocol_version = "HTTP/1.1"  # keep-alive: one TLS handshake per tab, not per poll
    server_version = "isthmus-status"
    sys_version = ""
    timeout = 30  # an idle or slow connection gives its thread back

    def do_GET(self) -> None:
        self._answer()

    def do_HEAD(self) -> None:
        self._answer()

    def __getattr__(self, name: str):
        # http.server answers a method without a do_METHOD with 501; every method but GET
        # and HEAD is answered by ``respond`` (405) instead.
        if name.startswith("do_"):
            return self._answer
        raise AttributeError(name)

    def _answer(self) -> None:
        srv = self.server
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True  # its body, if any, is not read
        if srv.authorizer is not None:
            problem = operator_problem(srv.authorizer, self.connection.getpeercert(True))
            reply = _text(403, f"refused: {problem}") if problem else None
        elif not host_header_ok(srv.access, self.headers.get("Host")):
            reply = _text(403, "this page answers only requests for 127.0.0.1 or localhost")
        else:
            reply = None
        try:
            reply = reply or respond(self.command, self.path, srv.sources)
        except Exception:  # a bug in a document must not take the page down
            log.exception("status page: %s %s", self.command, self.path[:80])
            reply = _text(500, "the coordinator could not build this document; see its log")
        self.send_response(reply.status)
        for name, value in (("Content-Type", reply.content_type), *_COMMON, *reply.headers):
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)

    def log_message(self, format: str, *args) -> None:
        log.debug("status page %s: " + format, self.address_string(), *args)


_COMMON = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)


class StatusPageServer(ThreadingHTTPServer):
    """The page's HTTP(S) server; TLS is handshaken in each connection's own thread."""

    daemon_threads = True

    def __init__(
        self,
        access: PageAccess,
        sources: PageSources,
        context: ssl.SSLContext | None = None,
        authorizer: Authorizer | None = None,
    ) -> None:
        self.access, self.sources = access, sources
        self.context, self.authorizer = context, authorizer
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.address_family = socket.AF_INET6 if ":" in access.host else socket.AF_INET
        super().__init__((access.host, access.port), _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many open: this one is dropped
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request, client_address) -> None:
        if self.context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(10)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:  # no or a foreign certificate, or no TLS
            log.debug("status page: TLS handshake with %s failed: %s", client_address, exc)
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            tls.close()

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="status-page", daemon=True)
        thread.start()
        return thread


def start_status_page(
    core, access: PageAccess, bundle: Bundle | None, crl: Path | None
) -> StatusPageServer:
    """Serve ``core``'s page as ``access`` says, on a daemon thread, and write its HOST:PORT to
    ``state_dir/status_page_address``. ``bundle``: the coordinator's own (the ``tls`` mode
    serves its certificate and checks readers against its CA and ``crl``)."""
    follower = LogFollower(core.cfg.state_dir / "events.jsonl")
    sources = PageSources(
        SnapshotCache(core.snapshot, SNAPSHOT_MAX_AGE_S), lambda: history_doc(follower.rounds())
    )
    context = authorizer = None
    if access.mode == "tls":
        assert bundle is not None, "page_access chose tls without the coordinator's bundle"
        context = server_context(bundle)
        authorizer = Authorizer(RevocationList(crl, bundle.ca))
    elif access.mode == "insecure":
        log.warning(
            "status page served on %s over plain HTTP without authentication (%s): anyone who "
            "reaches it reads the job's state",
            access.host,
            INSECURE_FLAG,
        )
    server = StatusPageServer(access, sources, context, authorizer)
    server.start()
    write_atomic(core.cfg.state_dir / "status_page_address", f"{server.address}\n".encode())
    log.info("status page on %s://%s/", access.scheme, server.address)
    return server
