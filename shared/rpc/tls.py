"""``TlsFiles``: a role's certificate, key and CA files, and the gRPC credentials made from them.

Every role takes ``--tls-cert-file``, ``--tls-key-file`` and ``--tls-ca-file`` (or
``GRIDSERVE_TLS_CERT_FILE`` / ``_KEY_FILE`` / ``_CA_FILE``); the CLI calls ``configure`` once with
them, and from then on the role's server requires a client certificate signed by that CA
(``server_credentials``) and its clients present their own (``channel_credentials``, used by
``shared.rpc.client``). Without them the process runs plaintext, as before.

Rotation: the files are read again whenever one of them changes (size or mtime) or after SIGHUP
(``reload``). The server's credentials are dynamic (gRPC asks for them on every handshake), so new
connections get the new certificate while open streams keep theirs; clients build a new channel for
new calls (``client.RotatingChannel``). A half-written pair (the key not matching the certificate)
is ignored until it matches.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import grpc

from gridserve.shared import envs
from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

FLAGS = ("--tls-cert-file", "--tls-key-file", "--tls-ca-file")


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path
    _forced: list = field(default_factory=lambda: [0], compare=False, repr=False)  # reload() count

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Optional[TlsFiles]:
        """All three flags or none; a missing or unreadable file is a ConfigError naming its flag."""
        values = {flag: getattr(args, flag.lstrip("-").replace("-", "_"), None) for flag in FLAGS}
        given = {flag: value for flag, value in values.items() if value}
        if not given:
            return None
        for flag in FLAGS:
            if flag not in given:
                raise ConfigError(flag.lstrip("-"), "TLS needs all of --tls-cert-file, --tls-key-file "
                                                    f"and --tls-ca-file: {flag} is missing")
            if not os.access(given[flag], os.R_OK):
                raise ConfigError(flag.lstrip("-"), f"cannot read {given[flag]}")
        return cls(Path(given[FLAGS[0]]), Path(given[FLAGS[1]]), Path(given[FLAGS[2]]))

    def argv(self) -> list[str]:
        return [FLAGS[0], str(self.cert), FLAGS[1], str(self.key), FLAGS[2], str(self.ca)]

    def stamp(self) -> tuple:
        """Changes whenever a file is replaced or rewritten, or ``reload`` was called."""
        stats = [os.stat(p) for p in (self.cert, self.key, self.ca)]
        return (self._forced[0], *((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats))

    def reload(self) -> None:
        """Read the files again at the next handshake / channel (SIGHUP)."""
        self._forced[0] += 1

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA) as PEM; ValueError when the key does not fit."""
        cert, key, ca = self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        _check_pair(cert, key)
        return cert, key, ca

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Client certificates required (signed by the CA); the files re-read on change."""
        state = {"stamp": self.stamp()}
        lock = threading.Lock()

        def configuration():
            cert, key, ca = self.read()
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        def fetch():  # called by gRPC before each handshake: None keeps the current configuration
            with lock:
                try:
                    stamp = self.stamp()
                    if stamp == state["stamp"]:
                        return None
                    config = configuration()
                except (OSError, ValueError) as exc:
                    logger.warning("TLS files %s not (yet) usable: %s; keeping the current ones", self.cert, exc)
                    return None
                state["stamp"] = stamp
                logger.info("TLS: serving the new certificate %s", self.cert)
                return config

        return grpc.dynamic_ssl_server_credentials(configuration(), fetch, require_client_authentication=True)


def _check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*fmt) != key.public_key().public_bytes(*fmt):
        raise ValueError("the private key does not match the certificate")


_UNSET = object()
_active: object = _UNSET


def configure(files: Optional[TlsFiles]) -> None:
    """This process's own certificate for its server and every client channel (None: plaintext)."""
    global _active
    _active = files


def active() -> Optional[TlsFiles]:
    """The configured files; until ``configure`` is called, those the ``GRIDSERVE_TLS_*`` variables
    name (so a library client such as a remote ``AsyncLLM`` presents its certificate too)."""
    global _active
    if _active is _UNSET:
        env = argparse.Namespace(**{flag.lstrip("-").replace("-", "_"):
                                    envs.flag_default(flag)
                                    for flag in FLAGS})
        _active = TlsFiles.from_args(env)
    return _active  # type: ignore[return-value]
