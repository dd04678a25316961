"""Telling a TLS problem from a network outage.

gRPC reports a certificate that does not hold the name dialled, or one from another CA, as
``UNAVAILABLE``, the same code as a coordinator that is down: callers would retry for minutes
something no retry fixes. When a failed call's details hint at TLS, ``diagnose`` dials the
address itself with the party's bundle, looks at the certificate the coordinator presents and
says what is wrong, in one line that names the fix. It says nothing (None) when it cannot
connect or finds nothing wrong: then the failure is treated as the outage it seems to be.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass

from cryptography import x509

from wire.identity import Bundle

TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "verif")


@dataclass(frozen=True)
class TlsProblem:
    """A TLS failure no retry can fix: ``kind`` is ``hostname``, ``ca`` or ``refused``."""

    kind: str
    message: str


def looks_like_tls(details: str | None) -> bool:
    """Whether a gRPC failure's details point at TLS (worth a ``diagnose``)."""
    text = (details or "").lower()
    return any(word in text for word in TLS_WORDS)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def cert_names(der: bytes) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for (its subjectAltName)."""
    cert = x509.load_der_x509_certificate(der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    dns = san.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return [*dns, *ips]


def host_matches(host: str, names: list[str]) -> bool:
    """Whether ``host`` is one of ``names`` (addresses compared as addresses, names without
    case; a ``*.`` wildcard covers one label)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for name in names:
        if ip is not None:
            try:
                if ipaddress.ip_address(name) == ip:
                    return True
            except ValueError:
                continue
            continue
        name, h = name.lower(), host.lower()
        if name == h or (name.startswith("*.") and h.partition(".")[2] == name[2:]):
            return True
    return False


def hostname_problem(host: str, names: list[str]) -> TlsProblem:
    flags = " ".join(f"--host {n}" for n in [*names, host])
    return TlsProblem(
        "hostname",
        f"TLS: the coordinator's certificate is not valid for {host!r}, the host dialled "
        f"(it holds: {', '.join(names) or 'no names'}); a retry will not fix this: dial one of "
        f"those names, or reissue the coordinator's bundle with `coordinator certs server "
        f"--ca PKI {flags}` and restart `coordinator serve`",
    )


def diagnose(address: str, bundle: Bundle, timeout: float = 2.0) -> TlsProblem | None:
    """Dial ``address`` with ``bundle`` and name a TLS problem no retry fixes, if there is one."""
    host, port = split_address(address)
    with tempfile.TemporaryDirectory(prefix="isthmus-probe-") as folder:
        cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        for path, data in ((cert, bundle.cert), (key, bundle.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False  # checked below, to say which names it holds
        ctx.load_verify_locations(cadata=bundle.ca.decode())
        ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["h2"])
        return _probe(ctx, host, port, timeout)


def _probe(ctx: ssl.SSLContext, host: str, port: int, timeout: float) -> TlsProblem | None:
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return None  # nothing listens, or the network is down: an outage after all
    try:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            names = cert_names(tls.getpeercert(binary_form=True))
            if not host_matches(host, names):
                return hostname_problem(host, names)
            return _refused_after_handshake(tls)
    except ssl.SSLCertVerificationError as exc:
        return TlsProblem(
            "ca",
            f"TLS: the coordinator's certificate does not verify against this bundle's "
            f"ca.pem ({exc.verify_message}): it belongs to another job's CA, or the bundle "
            "does; a retry will not fix this",
        )
    except ssl.SSLError as exc:
        return _alert(exc)
    except OSError:
        return None
    finally:
        raw.close()


def _refused_after_handshake(tls: ssl.SSLSocket) -> TlsProblem | None:
    """With TLS 1.3 the client's handshake ends before the server has checked the client's
    certificate: a refusal shows as the connection closed (or an alert) at the first read,
    where a gRPC server that took it sends its HTTP/2 settings or waits."""
    tls.settimeout(1.0)
    try:
        if tls.recv(1):
            return None
    except ssl.SSLError as exc:
        return _alert(exc)
    except OSError:
        return None  # a timeout: the coordinator took the certificate and waits for us
    return _refused("closed the connection")


def _alert(exc: ssl.SSLError) -> TlsProblem | None:
    reason = (exc.reason or str(exc)).lower()
    return _refused(reason) if "alert" in reason else None


def _refused(how: str) -> TlsProblem:
    return TlsProblem(
        "refused",
        f"TLS: the coordinator refused this bundle's certificate ({how} after the "
        "handshake): it was issued by another job's CA, or has expired; a retry will not "
        "fix this",
    )
