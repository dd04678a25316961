"""Job PKI and identities: the job's CA, certificates per role, revocation.

Every party of a job holds a bundle folder with ``cert.pem``, ``key.pem`` (mode 0600) and
``ca.pem``. A certificate names its holder in the common name and its role in the
organizational unit: ``site`` (may act only as that site), ``operator`` (may run status and
other operator commands) or ``coordinator`` (serves; its certificate also carries the host
names and addresses sites dial). Revocation is a CRL signed by the CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("site", "operator", "coordinator")
# The names the coordinator accepts for a site (coordinator.records.NAME_RE): also a safe
# folder name, as bundles are written to pki/sites/NAME and pki/operators/NAME.
PARTY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def check_party_name(flag: str, name: str) -> None:
    """Refuse a site or operator name that is not a plain folder name (``..``, ``a/b``)."""
    if not PARTY_NAME_RE.fullmatch(name):
        raise IdentityError(
            f"{flag} {name[:70]!r}: use 1-63 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit (it names the bundle's folder and the site in the job)"
        )


CERT, KEY, CA = "cert.pem", "key.pem", "ca.pem"
CA_CERT, CA_KEY, CRL, ISSUED = "ca.pem", "ca-key.pem", "crl.pem", "issued.json"


class IdentityError(ValueError):
    """A PKI operation that cannot be done; the message says what to fix."""


@dataclass(frozen=True)
class Identity:
    """Who a verified peer certificate says it is."""

    name: str
    role: str
    serial: int


@dataclass(frozen=True)
class Bundle:
    """A party's certificate, key and the job CA, as PEM bytes."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, folder: str | Path) -> Bundle:
        folder = Path(folder)
        parts = []
        for name in (CERT, KEY, CA):
            path = folder / name
            try:
                parts.append(path.read_bytes())
            except OSError as exc:
                raise IdentityError(
                    f"TLS bundle {folder}: cannot read {name} ({exc.strerror}); make one with "
                    "`coordinator certs issue|server|operator`"
                ) from exc
        return cls(*parts)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def init_ca(folder: str | Path, job: str, days: int = 3650) -> Path:
    """Create the job's CA in ``folder``; refuses to overwrite an existing one."""
    folder = Path(folder)
    if (folder / CA_KEY).exists():
        raise IdentityError(f"{folder} already holds a CA; refusing to overwrite it")
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"isthmus CA for {job}")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_private(folder / CA_KEY, _key_pem(key))
    (folder / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / ISSUED).write_text("{}")
    write_crl(folder, [])
    return folder


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), None)
    except (OSError, ValueError) as exc:
        raise IdentityError(
            f"no usable CA in {folder} ({exc}); create one with `coordinator certs init`"
        ) from exc
    return cert, key


def issue(
    ca_folder: str | Path,
    role: str,
    name: str,
    out: str | Path,
    *,
    hosts: tuple[str, ...] = (),
    days: float = 365,
    not_before: dt.datetime | None = None,
) -> Path:
    """Issue a certificate for ``name`` in ``role`` and write its bundle to ``out``."""
    if role not in ROLES:
        raise IdentityError(f"role must be one of {ROLES}, got {role!r}")
    if not name or not all(c.isalnum() or c in "._-" for c in name) or len(name) > 63:
        raise IdentityError(f"name {name!r}: use 1-63 letters, digits, '.', '_' or '-'")
    ca_folder, out = Path(ca_folder), Path(out)
    ca_cert, ca_key = _load_ca(ca_folder)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - dt.timedelta(minutes=5)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, name),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
        ]
    )
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
    )
    if role == "coordinator":
        if not hosts:
            raise IdentityError("a coordinator certificate needs at least one --host")
        usage.append(ExtendedKeyUsageOID.SERVER_AUTH)
        builder = builder.add_extension(x509.SubjectAlternativeName(_sans(hosts)), False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    out.mkdir(parents=True, exist_ok=True)
    _write_private(out / KEY, _key_pem(key))
    (out / CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / CA).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _record_issued(ca_folder, role, name, cert.serial_number)
    return out


def _sans(hosts: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _record_issued(ca_folder: Path, role: str, name: str, serial: int) -> None:
    path = ca_folder / ISSUED
    issued = json.loads(path.read_text()) if path.exists() else {}
    issued.setdefault(f"{role}/{name}", []).append(str(serial))
    path.write_text(json.dumps(issued, indent=1, sort_keys=True))


def revoke(ca_folder: str | Path, role: str, name: str) -> list[int]:
    """Revoke every certificate issued to ``role/name``; rewrites the CA's CRL."""
    ca_folder = Path(ca_folder)
    issued = json.loads((ca_folder / ISSUED).read_text())
    serials = [int(s) for s in issued.get(f"{role}/{name}", [])]
    if not serials:
        raise IdentityError(f"no {role} certificate was issued to {name!r} by this CA")
    crl = load_crl(ca_folder / CRL, _load_ca(ca_folder)[0])
    write_crl(ca_folder, sorted(set(crl) | set(serials)))
    return serials


def write_crl(ca_folder: Path, serials: list[int]) -> Path:
    ca_cert, ca_key = _load_ca(ca_folder)
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=3650))
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    path = ca_folder / CRL
    tmp = path.with_name(f".{CRL}.tmp")
    tmp.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    os.replace(tmp, path)
    return path


def load_crl(path: Path, ca_cert: x509.Certificate) -> set[int]:
    """Revoked serials from a CRL file, after checking the CA signed it."""
    crl = x509.load_pem_x509_crl(path.read_bytes())
    if not crl.is_signature_valid(ca_cert.public_key()):
        raise IdentityError(f"{path} is not signed by the job CA")
    return {r.serial_number for r in crl}


def verify_leaf(cert_pem: bytes, ca_cert: x509.Certificate) -> Identity:
    """Who a peer certificate names, once it is shown to be a leaf the job CA signed itself.

    The TLS handshake accepts any chain that ends at the job CA, and OpenSSL does not hold an
    intermediate to the CA's ``pathlen:0``: a leaf signed by a CA certificate the job CA once
    signed would pass. Only direct leaves, not CAs, meant for client authentication, are
    identities here."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    who = identity_of(cert_pem)
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise IdentityError(
            f"the certificate of {who.role} {who.name!r} was not issued by the job CA itself "
            f"({exc or 'bad signature'}); only the job CA's own leaves are accepted"
        ) from None
    ext = cert.extensions
    try:
        if ext.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise IdentityError(f"the certificate of {who.role} {who.name!r} is a CA certificate")
    except x509.ExtensionNotFound:
        raise IdentityError(
            f"the certificate of {who.role} {who.name!r} has no basicConstraints; "
            "issue it again with `coordinator certs`"
        ) from None
    try:
        if (
            ExtendedKeyUsageOID.CLIENT_AUTH
            not in ext.get_extension_for_class(x509.ExtendedKeyUsage).value
        ):
            raise IdentityError(f"the certificate of {who.role} {who.name!r} is not for clients")
    except x509.ExtensionNotFound:
        raise IdentityError(
            f"the certificate of {who.role} {who.name!r} has no extendedKeyUsage clientAuth"
        ) from None
    try:
        if not ext.get_extension_for_class(x509.KeyUsage).value.digital_signature:
            raise IdentityError(
                f"the certificate of {who.role} {who.name!r} may not sign (keyUsage)"
            )
    except x509.ExtensionNotFound:
        pass  # no keyUsage: any use (RFC 5280); certificates issued before it was added
    return who


def identity_of(cert_pem: bytes) -> Identity:
    cert = x509.load_pem_x509_certificate(cert_pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return Identity(
        name=str(cn[0].value) if cn else "",
        role=str(ou[0].value) if ou else "",
        serial=cert.serial_number,
    )
