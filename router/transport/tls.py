"""TLS for the listeners: a server context (ALPN ``h2`` for gRPC, ``http/1.1`` for the proxy and the
sidecar) from PEM files, reloaded when they change.

``ServerTls.load(cert_file, key_file)`` builds the context ``H2GrpcServer.start(..., ssl=...)``
takes; without files it generates a self-signed certificate and key first (``self_signed``: a
test or a demo, or a mesh that does not verify). While ``async with`` is open it looks at the
files' mtimes every ``reload_interval_s`` and loads a changed pair into the *same* context, so
connections accepted afterwards present the new certificate and open ones keep theirs (cert-manager
and kubelet rotate mounted secrets in place).

A pair is loaded only once it is complete and matching: the files are copied to a private
directory, the copy is tried on a scratch context, and only then loaded into the live one from
that same copy (a live ``load_cert_chain`` that failed half-way would leave the context without a
certificate). A rotation caught half-written is logged and retried at the next look.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import os
import shutil
import ssl
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ALPN = ["h2"]
HTTP1_ALPN = ["http/1.1"]
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}  # the config's names
# RFC 9113 9.2.2: HTTP/2 over TLS 1.2 needs an ephemeral key exchange and an AEAD cipher.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"
SELF_SIGNED_HOSTS = ("localhost", "127.0.0.1", "::1")


def server_context(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    *,
    minimum_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2,
    alpn: list[str] = ALPN,
) -> ssl.SSLContext:
    """A server context: the certificate chain and key, ``alpn`` offered, TLS ≥ ``minimum_version``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = minimum_version
    context.set_ciphers(_TLS12_CIPHERS)  # TLS 1.3's suites are all AEAD and not set here
    # RFC 9113 9.2.1: no TLS compression, no renegotiation.
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    context.set_alpn_protocols(alpn)
    context.load_cert_chain(cert_file, key_file)
    return context


def self_signed(
    directory: str | os.PathLike[str], hosts: tuple[str, ...] = SELF_SIGNED_HOSTS, days: int = 365
) -> tuple[Path, Path]:
    """Write a self-signed certificate for ``hosts`` (DNS names or IPs) and its key; returns the paths.

    Needs the ``cryptography`` package. The key is an ECDSA P-256 key (generated in milliseconds),
    readable by the owner only. The certificate is its own CA: a client trusts it by loading it
    as its root.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError as exc:  # pragma: no cover - a dependency; the message says what is missing
        raise RuntimeError("a self-signed certificate needs the 'cryptography' package") from exc

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "pd-router")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clock skew with clients
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "tls.crt", folder / "tls.key"
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(key_pem)
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


_Signature = tuple[tuple[int, int, int], tuple[int, int, int]]


class ServerTls:
    """A server ``SSLContext`` and the files it came from; reloads them into it when they change."""

    def __init__(
        self,
        cert_file: str | os.PathLike[str],
        key_file: str | os.PathLike[str],
        *,
        minimum_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2,
        reload_interval_s: float = 5.0,
        alpn: list[str] = ALPN,
        owned_directory: Path | None = None,
    ) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.minimum_version = minimum_version
        self.reload_interval_s = reload_interval_s
        self.alpn = alpn
        self._owned = owned_directory  # a generated pair's directory, removed on close
        self._staging = Path(tempfile.mkdtemp(prefix="pd-router-tls-"))  # mode 0700
        self._signature = self._stat()
        self._rejected: _Signature | None = None
        self.context = server_context(*self._stage(), minimum_version=minimum_version, alpn=alpn)
        self._watcher: asyncio.Task[None] | None = None

    @classmethod
    def load(
        cls,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        *,
        minimum_version: ssl.TLSVersion | str = ssl.TLSVersion.TLSv1_2,
        reload_interval_s: float = 5.0,
        alpn: list[str] = ALPN,
        self_signed_hosts: tuple[str, ...] = SELF_SIGNED_HOSTS,
    ) -> ServerTls:
        """From the files, or from a self-signed pair generated now when neither is given.
        ``minimum_version`` may be the config's name for it ("1.2", "1.3")."""
        if (cert_file is None) != (key_file is None):
            raise ValueError("TLS needs both a certificate file and a key file, or neither (self-signed)")
        if isinstance(minimum_version, str):
            minimum_version = VERSIONS[minimum_version]
        options = {"minimum_version": minimum_version, "reload_interval_s": reload_interval_s, "alpn": alpn}
        if cert_file is None or key_file is None:
            directory = Path(tempfile.mkdtemp(prefix="pd-router-self-signed-"))
            cert_file, key_file = self_signed(directory, self_signed_hosts)
            log.info("TLS: no certificate configured; serving a self-signed one for %s", self_signed_hosts)
            return cls(cert_file, key_file, owned_directory=directory, **options)  # type: ignore[arg-type]
        return cls(cert_file, key_file, **options)  # type: ignore[arg-type]

    def _stat(self) -> _Signature:
        """What changes when a file is replaced or rewritten: inode, size, mtime (ns)."""
        cert, key = os.stat(self.cert_file), os.stat(self.key_file)
        return (cert.st_ino, cert.st_size, cert.st_mtime_ns), (key.st_ino, key.st_size, key.st_mtime_ns)

    def _stage(self) -> tuple[Path, Path]:
        """Copy the pair to the private directory: what is checked is what is loaded."""
        cert, key = self._staging / "tls.crt", self._staging / "tls.key"
        shutil.copyfile(self.cert_file, cert)
        descriptor = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(self.key_file.read_bytes())
        return cert, key

    def reload_if_changed(self) -> bool:
        """Load the files into the context if they changed since the last load; True if loaded."""
        try:
            signature = self._stat()
        except OSError as exc:  # mid-rotation (a symlink swapped): look again next time
            log.warning("TLS: cannot stat %s / %s: %s", self.cert_file, self.key_file, exc)
            return False
        if signature in (self._signature, self._rejected):
            return False
        try:
            cert, key = self._stage()
            # On a scratch context first: a bad pair raises there.
            server_context(cert, key, minimum_version=self.minimum_version, alpn=self.alpn)
            self.context.load_cert_chain(cert, key)  # the very bytes just checked
        except (OSError, ssl.SSLError) as exc:
            log.warning(
                "TLS: keeping the current certificate; %s + %s do not load: %s",
                self.cert_file,
                self.key_file,
                exc,
            )
            self._rejected = signature
            return False
        self._signature = signature
        log.info("TLS: certificate reloaded from %s", self.cert_file)
        return True

    async def watch(self) -> None:
        """Reload changed files every ``reload_interval_s``, until cancelled."""
        while True:
            await asyncio.sleep(self.reload_interval_s)
            self.reload_if_changed()

    async def __aenter__(self) -> ServerTls:
        self._watcher = asyncio.get_running_loop().create_task(self.watch())
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        self.close()

    def close(self) -> None:
        """Remove the private copies (and a generated pair)."""
        shutil.rmtree(self._staging, ignore_errors=True)
        if self._owned is not None:
            shutil.rmtree(self._owned, ignore_errors=True)


async def started(
    cert_file: str | None,
    key_file: str | None,
    minimum_version: str = "1.2",
    reload_interval_s: float = 5.0,
    *,
    alpn: list[str] = ALPN,
) -> ServerTls:
    """A ``ServerTls`` watching its files (from the files, or self-signed without them) for a
    listener that offers ``alpn``; the caller leaves it (``__aexit__``) when the listener stops."""
    tls = ServerTls.load(
        cert_file, key_file, minimum_version=minimum_version, reload_interval_s=reload_interval_s, alpn=alpn
    )
    return await tls.__aenter__()
