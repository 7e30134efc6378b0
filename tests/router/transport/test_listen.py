"""A listener that cannot bind says which listener and which address, in one typed error."""

from __future__ import annotations

import errno
import socket

import pytest

from router.transport.h2.server import H2GrpcServer
from router.transport.listen import ListenError, binding


def test_an_address_in_use_names_the_listener_and_the_address_once() -> None:
    cause = OSError(errno.EADDRINUSE, "error while attempting to bind on address ('127.0.0.1', 8000): x")
    with pytest.raises(ListenError) as caught, binding("proxy listener", "127.0.0.1", 8000):
        raise cause
    assert caught.value.errno == errno.EADDRINUSE
    said = "the proxy listener cannot listen on 127.0.0.1:8000: Address already in use"
    assert caught.value.strerror == said
    assert caught.value.__cause__ is cause


def test_a_host_that_does_not_resolve_keeps_the_resolvers_words() -> None:
    with pytest.raises(ListenError) as caught, binding("metrics listener", "nowhere.invalid", 9090):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    said = "the metrics listener cannot listen on nowhere.invalid:9090: Name or service not known"
    assert caught.value.strerror == said


def test_other_errors_pass_through_unchanged() -> None:
    with pytest.raises(ValueError, match="not a bind"), binding("proxy listener", "", 1):
        raise ValueError("not a bind")


async def test_the_grpc_server_raises_it_for_a_port_in_use_and_keeps_nothing_open() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = H2GrpcServer({})
        with pytest.raises(ListenError, match=f"the KEDA scaler listener cannot listen on 127.0.0.1:{port}"):
            await server.start("127.0.0.1", port, what="KEDA scaler listener")
        assert server._listeners == []
