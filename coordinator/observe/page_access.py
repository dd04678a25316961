"""Who may read the status page (``coordinator serve --status-page [HOST:]PORT``).

Three ways to serve it, chosen once at start by ``page_access`` (pure):

``loopback``
    Plain HTTP on 127.0.0.1 (the default) or another loopback address: only this machine
    reaches it (an SSH tunnel brings it to a laptop). Requests must name a loopback host in
    their ``Host`` header, so a web page whose name was rebound to 127.0.0.1 cannot read it.
``tls``
    Any other address, when the coordinator serves with ``--tls-dir``: HTTPS with the
    coordinator's own certificate, and a client certificate required, issued by the job CA
    itself for the ``operator`` role and not revoked: the same checks as a gRPC ``Status``
    call (``coordinator.service.auth.Authorizer``).
``insecure``
    Any other address with ``--status-page-insecure``: plain HTTP, logged as a warning.
    Anyone who reaches it reads the job's state (nothing on the page can change it).

Any other address without either is refused at start.
"""

from __future__ import annotations

import ipaddress
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from coordinator.service.auth import AuthError, Authorizer
from wire.identity import Bundle
from wire.net.metrics_http import MetricsAddressError, is_loopback, parse_http_address

FLAG = "--status-page"
INSECURE_FLAG = "--status-page-insecure"
MODES = ("loopback", "tls", "insecure")


class PageAccessError(ValueError):
    """A ``--status-page`` that cannot be served; the message says what to pass instead."""


@dataclass(frozen=True)
class PageAccess:
    """Where the page is served and how its readers are checked (one of ``MODES``)."""

    host: str
    port: int
    mode: str

    @property
    def scheme(self) -> str:
        return "https" if self.mode == "tls" else "http"


def page_access(text: str, *, tls: bool, insecure: bool) -> PageAccess:
    """How to serve ``--status-page text``.

    Parameters
    ----------
    text
        ``PORT`` (on 127.0.0.1) or ``HOST:PORT``; port 0 picks a free one.
    tls
        The coordinator serves with its TLS bundle (``--tls-dir``).
    insecure
        ``--status-page-insecure`` was given.

    Raises
    ------
    PageAccessError
        ``text`` is no address, or it is not loopback and neither TLS nor the flag allow it.
    """
    try:
        host, port = parse_http_address(text, FLAG)
    except MetricsAddressError as exc:
        raise PageAccessError(str(exc)) from None
    if is_loopback(host):
        return PageAccess(host, port, "loopback")
    if insecure:
        return PageAccess(host, port, "insecure")
    if tls:
        return PageAccess(host, port, "tls")
    raise PageAccessError(
        f"{FLAG} {text}: not a loopback address, and the coordinator runs --insecure; serve "
        f"with --tls-dir (the page then asks for an operator certificate of the job CA) or add "
        f"{INSECURE_FLAG} (plain HTTP: anyone who reaches it reads the job's state)"
    )


def host_header_ok(access: PageAccess, header: str | None) -> bool:
    """Whether a request's ``Host`` header may be answered (only loopback names on a loopback
    page: the defence against DNS rebinding; any name otherwise)."""
    if access.mode != "loopback":
        return True
    if not header:
        return False
    host = header.strip()
    if host.startswith("["):  # [::1]:8080
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.lower() == "localhost" or _is_loopback_ip(host)


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_context(bundle: Bundle) -> ssl.SSLContext:
    """TLS for the ``tls`` mode: the coordinator's certificate, client certificates required
    and chained to the job CA (the role is checked per request, by ``operator_problem``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=bundle.ca.decode())
    # ssl loads a certificate and key only from files: a private folder, gone once loaded.
    with tempfile.TemporaryDirectory(prefix="isthmus-page-") as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(bundle.cert)
        key.touch(mode=0o600)
        key.write_bytes(bundle.key)
        ctx.load_cert_chain(cert, key)
    return ctx


def operator_problem(authorizer: Authorizer, peer_der: bytes | None) -> str | None:
    """Why the TLS peer whose certificate is ``peer_der`` may not read the page; None if it
    may (an unrevoked operator certificate the job CA issued itself)."""
    if not peer_der:
        return "a client certificate from the job CA is required"
    pem = ssl.DER_cert_to_PEM_cert(peer_der).encode()
    try:
        authorizer.check({"x509_pem_cert": [pem]}, "operator")
    except AuthError as exc:
        return str(exc)
    return None
