"""Who is calling: the verified client certificate, its role, and the revocation list.

gRPC has already checked, during the TLS handshake, that the peer's certificate chains to the
job CA and is within its validity period. This adds what the handshake does not know: that the
certificate is a leaf the job CA signed itself (not one signed by an intermediate), the role a
method needs, that a site acts only as itself, and revocations, read from the CA-signed CRL
file again whenever it changes, so ``coordinator certs revoke`` takes effect on a running
coordinator at the next call.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

from cryptography import x509

from wire.identity import Identity, IdentityError, load_crl, verify_leaf

log = logging.getLogger("isthmus.coordinator")


class AuthError(Exception):
    """A caller that may not do what it asked; ``code`` is "unauthenticated" or "denied"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RevocationList:
    """Revoked serials from a CRL file, reloaded when the file changes."""

    def __init__(self, path: Path | None, ca_pem: bytes) -> None:
        self.path = path
        self.ca = x509.load_pem_x509_certificate(ca_pem)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._serials: set[int] = set()
        if path is not None:
            self.serials()  # a bad CRL at start-up is an error, not a warning

    def serials(self) -> set[int]:
        if self.path is None:
            return set()
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                return self._serials
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                try:
                    self._serials = load_crl(self.path, self.ca)
                    log.info("revocation list %s: %d revoked", self.path, len(self._serials))
                except (IdentityError, ValueError, OSError) as exc:
                    if self._stamp is None:
                        raise IdentityError(f"revocation list {self.path}: {exc}") from exc
                    log.error("ignoring unusable revocation list %s: %s", self.path, exc)
                self._stamp = stamp
            return self._serials


class Authorizer:
    """Checks each call's certificate; ``None`` callers are allowed only when insecure."""

    def __init__(self, revocations: RevocationList | None) -> None:
        self.revocations = revocations
        if revocations is not None:
            self._verify = functools.lru_cache(maxsize=1024)(self._verify_uncached)

    @property
    def insecure(self) -> bool:
        return self.revocations is None

    def _verify_uncached(self, cert_pem: bytes) -> Identity | IdentityError:
        try:
            return verify_leaf(cert_pem, self.revocations.ca)
        except (IdentityError, ValueError) as exc:
            return IdentityError(str(exc))

    def identify(self, auth_context: dict) -> Identity | None:
        """The verified, unrevoked caller; None when insecure. Raises ``AuthError``."""
        if self.insecure:
            return None
        pems = auth_context.get("x509_pem_cert")
        if not pems:
            raise AuthError("unauthenticated", "a client certificate from the job CA is required")
        who = self._verify(pems[0])
        if isinstance(who, IdentityError):
            raise AuthError("unauthenticated", str(who))
        if who.serial in self.revocations.serials():
            raise AuthError(
                "unauthenticated", f"the certificate of {who.role} {who.name!r} was revoked"
            )
        return who

    def check(self, auth_context: dict, role: str, claimed_site: str | None = None):
        who = self.identify(auth_context)
        if who is None:
            return None
        if who.role != role:
            raise AuthError(
                "denied",
                f"{_a(who.role)} {who.role} certificate ({who.name!r}) may not call this; "
                f"it needs {_a(role)} {role} certificate",
            )
        if claimed_site is not None and claimed_site != who.name:
            raise AuthError(
                "denied",
                f"the certificate is for site {who.name!r} but the request claims site "
                f"{claimed_site[:70]!r}",
            )
        return who


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"
