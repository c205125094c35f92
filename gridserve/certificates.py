"""``LocalCA``: a throwaway CA and one certificate per role, for ``gridserve serve --tls`` and tests.

Everything lives in a private directory (mode 0700, keys 0600) that ``cleanup`` removes. Each
certificate names its role the way ``shared.rpc.authz`` reads it: common name ``<role>`` and DNS SAN
``<role>.gridserve.internal``; server roles also carry ``localhost`` and ``127.0.0.1`` so clients
verify the host they dial on loopback. Engines and gateways get one certificate per instance
(``issue_all(instances=)``), which also names the instance: ``engine-1.gridserve.internal``.

A CA made for a ``deployment`` (``serve --tls`` picks a random name) also scopes every name to it,
``<role>[-<id>].<deployment>.gridserve.internal``: the only names a role started with
``--tls-deployment <deployment>`` reads (the unscoped role name stays, read only where no deployment is
set; the edge's Envoy matches ``gateway[-<n>].<deployment>.gridserve.internal`` too). EC P-256 keys (fast handshakes), SHA-256 signatures.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gridserve.shared.rpc.authz import DNS_SUFFIX
from gridserve.shared.rpc.tls import TlsFiles

ROLES = ("worker", "engine", "gateway", "coordinator", "edge", "admin")
VALIDITY = datetime.timedelta(days=7)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write atomically (a reader sees the old file or the new one, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class LocalCA:
    """A CA in ``folder`` (default: a new private temp dir) and the certificates it issued there,
    scoped to ``deployment`` when given."""

    def __init__(self, folder: Optional[Path] = None, name: Optional[str] = None,
                 deployment: Optional[str] = None) -> None:
        self.deployment = deployment
        self._owned = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="gridserve-tls-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self._key = ec.generate_private_key(ec.SECP256R1())
        # A name of its own: a bundle of two CAs (a trust rotation) must not have two of one subject.
        name = name or f"gridserve local CA {os.urandom(4).hex()}"
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .sign(self._key, hashes.SHA256()))
        self.ca_pem = self._cert.public_bytes(serialization.Encoding.PEM)
        self.ca_file = self.folder / "ca.crt"
        _write(self.ca_file, self.ca_pem)

    def issue(self, role: str, name: Optional[str] = None, instance: Optional[str] = None,
              deployment: Optional[str] = None) -> TlsFiles:
        """A certificate and key for ``role`` (files ``<name>.crt`` / ``<name>.key``, default the role's
        name; issuing again replaces them atomically: a rotation). With ``instance`` it also names
        that one instance of the role, DNS SAN ``<role>-<instance>.gridserve.internal`` (``engine-1``:
        DP rank 1), which the coordinator and the engines bind ranks and streams to. Its names are
        scoped to ``deployment`` (default: the CA's; ``""``: none), ``<role>[-<instance>].<deployment>.gridserve.internal``."""
        name = name or role
        deployment = self.deployment if deployment is None else deployment
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        suffix = f".{deployment}{DNS_SUFFIX}" if deployment else DNS_SUFFIX
        sans: list[x509.GeneralName] = [x509.DNSName(role + suffix), x509.DNSName("localhost"),
                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        if instance is not None:
            sans.insert(1, x509.DNSName(f"{role}-{instance}{suffix}"))
        if deployment:
            sans.insert(0, x509.DNSName(role + DNS_SUFFIX))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._key, hashes.SHA256()))
        # Each role its own copy of the CA, so one role's trust can be rotated alone.
        files = TlsFiles(self.folder / f"{name}.crt", self.folder / f"{name}.key", self.folder / f"{name}-ca.crt")
        if not files.ca.exists():
            _write(files.ca, self.ca_pem)
        # Key first: until the certificate follows, readers see a mismatched pair and keep the old one.
        _write(files.key, _pem_key(key), 0o600)
        _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
        return files

    def issue_all(self, instances: Optional[dict[str, int]] = None) -> dict[str, TlsFiles]:
        """One certificate per role; a role given a count in ``instances`` (``{"engine": 2}``) gets one
        per instance instead: instance 0 under the role's own key and files, instance i > 0 under
        ``<role>-<i>``."""
        files = {}
        for role in ROLES:
            count = (instances or {}).get(role)
            if count is None:
                files[role] = self.issue(role)
                continue
            for i in range(count):
                files[role if i == 0 else f"{role}-{i}"] = self.issue(role, None if i == 0 else f"{role}-{i}",
                                                                       instance=str(i))
        return files

    def cleanup(self) -> None:
        if self._owned:
            shutil.rmtree(self.folder, ignore_errors=True)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step (a rotation of a CA bundle)."""
    _write(Path(path), data)


def serial_of(cert_pem: bytes) -> int:
    return x509.load_pem_x509_certificate(cert_pem).serial_number
