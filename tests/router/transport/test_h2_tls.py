"""TLS on the HTTP/2 gRPC server: grpcio over TLS, ALPN h2, certificate reload, minimum version."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from h2client import DATA, END_STREAM, PREFACE, H2Client, frame, grpc_message
from helpers import eventually

from router.adapters.health import CHECK_METHOD, HealthState
from router.transport.h2.limits import H2Limits
from router.transport.h2.server import H2GrpcServer
from router.transport.tls import ServerTls, self_signed

SERVING = health_pb2.HealthCheckResponse.SERVING


async def serve(
    tls: ServerTls | None, *, cleartext: bool = True, **limits: float
) -> tuple[H2GrpcServer, int]:
    health = HealthState()
    health.set_ready(True)
    server = H2GrpcServer(health.methods(), limits=dataclasses.replace(H2Limits(), **limits))
    return server, await server.start(
        "127.0.0.1", 0, ssl=tls.context if tls is not None else None, cleartext=cleartext
    )


async def liveness(client: H2Client, stream_id: int = 1) -> int:
    request = health_pb2.HealthCheckRequest(service="liveness").SerializeToString()
    await client.send(
        client.request(stream_id, CHECK_METHOD), frame(DATA, END_STREAM, stream_id, grpc_message(request))
    )
    [reply] = (await client.read_stream(stream_id)).messages
    return health_pb2.HealthCheckResponse.FromString(reply).status


@pytest.fixture
async def servers() -> AsyncIterator[list[H2GrpcServer]]:
    started: list[H2GrpcServer] = []
    yield started
    for server in started:
        await server.stop(0)


def _unverified() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


def client_context(cert: Path, *, maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    """A client that trusts ``cert`` (self-signed: its own root) and offers ALPN h2."""
    context = ssl.create_default_context(cafile=str(cert))
    context.set_alpn_protocols(["h2"])
    if maximum is not None:
        context.maximum_version = maximum
    return context


async def peer_certificate(port: int, trusted: Path | None) -> tuple[bytes, str | None]:
    """The certificate (DER) a new TLS connection is shown, and the ALPN protocol agreed.

    With ``trusted`` None the certificate is not verified (to see which one is shown)."""
    context = client_context(trusted) if trusted is not None else _unverified()
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="localhost")
    try:
        tls = writer.get_extra_info("ssl_object")
        return tls.getpeercert(binary_form=True), tls.selected_alpn_protocol()
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def tls_server(
    directory: Path, servers: list[H2GrpcServer], *, cleartext: bool = True, **tls_options: Any
) -> AsyncIterator[tuple[Path, H2GrpcServer, int]]:
    """A server on a fresh self-signed pair in ``directory``: yields (its certificate, server, port)."""
    cert, key = self_signed(directory)
    tls = ServerTls(cert, key, **tls_options)
    try:
        server, port = await serve(tls, cleartext=cleartext)
        servers.append(server)
        yield cert, server, port
    finally:
        tls.close()


async def health_check(port: int, trusted: Path) -> int:
    credentials = grpc.ssl_channel_credentials(root_certificates=trusted.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5.0)
        return reply.status


async def test_grpcio_health_check_over_tls_with_a_generated_certificate(servers: list[H2GrpcServer]) -> None:
    tls = ServerTls.load()  # no files: a self-signed pair for localhost, 127.0.0.1 and ::1
    try:
        server, port = await serve(tls)
        servers.append(server)
        assert await health_check(port, tls.cert_file) == SERVING
        der, alpn = await peer_certificate(port, tls.cert_file)
        assert alpn == "h2"
        assert der == ssl.PEM_cert_to_DER_cert(tls.cert_file.read_text())
    finally:
        tls.close()
    assert not tls.cert_file.exists()  # a generated pair does not outlive its owner


async def test_alpn_is_h2_and_a_raw_http2_client_is_served_over_tls(
    tmp_path: Path, servers: list[H2GrpcServer]
) -> None:
    async with tls_server(tmp_path, servers) as (cert, _, port):
        client = await H2Client.connect(port, tls=client_context(cert))
        try:
            assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
            assert await liveness(client) == SERVING
        finally:
            await client.close()


async def test_a_rotated_certificate_is_shown_to_new_connections(
    tmp_path: Path, servers: list[H2GrpcServer]
) -> None:
    cert, key = self_signed(tmp_path / "live")
    first = cert.read_bytes()
    async with ServerTls(cert, key, reload_interval_s=0.05) as tls:
        server, port = await serve(tls)
        servers.append(server)
        old_client = await H2Client.connect(port, tls=client_context(cert))
        try:
            # Rotate as a secret mount does: whole new files in place, certificate and key.
            new_cert, new_key = self_signed(tmp_path / "next")
            shutil.copyfile(new_key, key)
            shutil.copyfile(new_cert, cert)
            assert cert.read_bytes() != first

            async def shows_the_new_one() -> bool:
                der, _ = await peer_certificate(port, None)
                return der == ssl.PEM_cert_to_DER_cert(new_cert.read_text())

            await eventually(shows_the_new_one, timeout_s=5.0, what="the new certificate on a new connection")
            assert await health_check(port, new_cert) == SERVING
            assert await old_client.barrier() == []  # a connection made before goes on with the old one
        finally:
            await old_client.close()


async def test_a_half_written_rotation_keeps_the_current_certificate(
    tmp_path: Path, servers: list[H2GrpcServer]
) -> None:
    cert, key = self_signed(tmp_path / "live")
    original = tmp_path / "original.crt"
    shutil.copyfile(cert, original)
    tls = ServerTls(cert, key)
    try:
        server, port = await serve(tls)
        servers.append(server)
        new_cert, _ = self_signed(tmp_path / "next")
        shutil.copyfile(new_cert, cert)  # the certificate is new, its key not there yet
        assert not tls.reload_if_changed()
        der, _ = await peer_certificate(port, original)
        assert der == ssl.PEM_cert_to_DER_cert(original.read_text())
        assert await health_check(port, original) == SERVING
    finally:
        tls.close()


async def test_a_tls12_client_is_refused_when_the_minimum_is_13(
    tmp_path: Path, servers: list[H2GrpcServer]
) -> None:
    async with tls_server(tmp_path, servers, minimum_version=ssl.TLSVersion.TLSv1_3) as (cert, _, port):
        with pytest.raises((ssl.SSLError, ConnectionResetError)):  # an alert, or the reset after it
            await asyncio.open_connection(
                "127.0.0.1",
                port,
                ssl=client_context(cert, maximum=ssl.TLSVersion.TLSv1_2),
                server_hostname="localhost",
            )
        _, alpn = await peer_certificate(port, cert)  # a TLS 1.3 client is fine
        assert alpn == "h2"
        assert await health_check(port, cert) == SERVING


def test_a_certificate_without_its_key_is_a_configuration_error(tmp_path: Path) -> None:
    cert, _ = self_signed(tmp_path)
    with pytest.raises(ValueError, match="both"):
        ServerTls.load(cert, None)
    assert os.stat(tmp_path / "tls.key").st_mode & 0o077 == 0  # the key is the owner's alone


# -- TLS and h2c on one port ------------------------------------------------------------------------
async def test_one_port_serves_tls_and_cleartext_clients_side_by_side(
    tmp_path: Path, servers: list[H2GrpcServer]
) -> None:
    """A gateway configured for TLS and one configured for h2c both reach a TLS-on picker."""
    async with tls_server(tmp_path, servers) as (cert, server, port):
        secure = await H2Client.connect(port, tls=client_context(cert))
        clear = await H2Client.connect(port)
        try:
            assert secure.writer.get_extra_info("ssl_object") is not None
            assert clear.writer.get_extra_info("ssl_object") is None
            assert await liveness(secure) == SERVING
            assert await liveness(clear) == SERVING
            assert len(server.connections) == 2
        finally:
            await secure.close()
            await clear.close()


async def test_a_tls_only_port_closes_a_cleartext_client(
    tmp_path: Path, servers: list[H2GrpcServer], caplog: pytest.LogCaptureFixture
) -> None:
    async with tls_server(tmp_path, servers, cleartext=False) as (cert, _, port):
        clear = await H2Client.connect(port, handshake=False)
        await clear.send(PREFACE)
        with contextlib.suppress(ConnectionResetError):  # closed with our preface unread: a reset
            assert await clear.reader.read() == b""  # closed without a byte of HTTP/2
        assert "cleartext (h2c) client on a TLS-only port" in caplog.text
        secure = await H2Client.connect(port, tls=client_context(cert))
        assert await liveness(secure) == SERVING  # TLS clients are served meanwhile
        await secure.close()


async def test_a_cleartext_port_tells_a_tls_client_apart(
    servers: list[H2GrpcServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Not a PROTOCOL_ERROR about a bad preface: the log names the mismatch."""
    server, port = await serve(None)
    servers.append(server)
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await H2Client.connect(port, handshake=False, tls=_unverified())
    assert "a TLS client on a cleartext port" in caplog.text
    assert not server.connections


async def test_connections_that_never_send_a_byte_are_closed_and_bounded(
    servers: list[H2GrpcServer], caplog: pytest.LogCaptureFixture
) -> None:
    server, port = await serve(None, handshake_timeout_s=0.3, max_connections=4)
    servers.append(server)
    silent = []
    for _ in range(6):  # past the cap of connections still opening: the newest are refused
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setblocking(False)
        silent.append(sock)
    loop = asyncio.get_running_loop()
    try:
        for sock in silent:  # every one ends: refused at the cap, or at the handshake timeout
            assert await asyncio.wait_for(loop.sock_recv(sock, 1), 5) == b""
        assert "still opening: refusing" in caplog.text  # (warnings are one a second: the first)
        client = await H2Client.connect(port)
        assert await liveness(client) == SERVING
        await client.close()
    finally:
        for sock in silent:
            sock.close()
