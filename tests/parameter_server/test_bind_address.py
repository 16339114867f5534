"""``ds.Server(bind_address=...)`` (issue 11, item 5): listen on every interface, as TF's servers do, token still required.

Behind NAT or a Kubernetes Service the spec's address is the one the other tasks reach, not an
address of the server's host: listening on it fails. ``bind_address="0.0.0.0"`` (or ``"::"``, or
``DISTRIB_BIND_ADDRESS``) listens on every interface at the task's port; the wildcard listener
must refuse a call without the cluster token exactly as the exact-address one does. The
cross-host run of the same is in tests/cluster/test_two_hosts.py (root only).
"""

from __future__ import annotations

import socket

import grpc
import pytest

import distrib as ds
from distrib.parameter_server.errors import AuthenticationError
from distrib.parameter_server.server.server import listen_address, routed_address
from distrib.parameter_server.transport import rpc, wire

TOKEN = "bind-test-token-0123456789abcdef"


def free_port(family: int = socket.AF_INET) -> int:
    with socket.socket(family) as s:
        s.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        return s.getsockname()[1]


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def spec(port: int) -> dict[str, list[str]]:
    """A cluster whose ps address is a Service-like name that is not this host's (nor resolvable)."""
    return {"chief": ["chief.distrib-test.invalid:1"], "ps": [f"ps-0.distrib-test.invalid:{port}"]}


def probe(address: str, metadata: tuple = ()) -> grpc.StatusCode:
    """A raw call to the ps service at ``address`` with ``metadata``: its status code (OK when answered)."""
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary("/distrib.ParameterServer/Health")(wire.encode({}), timeout=20, metadata=metadata,
                                                                    wait_for_ready=True)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("bind, reach", [("0.0.0.0", "127.0.0.1"), ("::", "[::1]")])
def test_a_wildcard_listener_still_requires_the_token(bind, reach):
    if reach.startswith("[") and not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    port = free_port()
    server = ds.Server(spec(port), "ps", 0, token=TOKEN, bind_address=bind)
    try:
        assert server.address == f"ps-0.distrib-test.invalid:{port}"  # the spec's, where others reach it
        assert server.bind_address == (f"0.0.0.0:{port}" if bind == "0.0.0.0" else f"[::]:{port}")
        target = f"{reach}:{port}"
        assert probe(target) == grpc.StatusCode.UNAUTHENTICATED  # no token at all
        assert probe(target, ((rpc.TOKEN_METADATA, "wrong-token-0123456789abcdef"),)) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(AuthenticationError, match="DISTRIB_CLUSTER_TOKEN"):
            rpc.Connection(target, rpc.PS_SERVICE, "another-token-0123456789abcdef").call("Health", wire.encode({}),
                                                                                        timeout=20)
        health = wire.decode(rpc.Connection(target, rpc.PS_SERVICE, TOKEN).call("Health", wire.encode({}), timeout=20))
        assert health["ok"] and health["decoded"] == 1  # only the call with the token was ever decoded
    finally:
        server.stop(grace=0)


def test_distrib_bind_address_is_read_when_bind_address_is_not_given(monkeypatch):
    port = free_port()
    monkeypatch.setenv("DISTRIB_BIND_ADDRESS", "127.0.0.1")
    server = ds.Server(spec(port), "ps", 0, token=TOKEN)
    try:
        assert server.bind_address == f"127.0.0.1:{port}"
        assert probe(f"127.0.0.1:{port}") == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(grace=0)


def test_an_address_not_of_this_host_is_refused_naming_bind_address():
    """Without bind_address a server listens on the spec's exact address: one of another host is a clear error."""
    port = free_port()
    with pytest.raises(OSError, match=r"cannot listen on '203\.0\.113\.7:\d+'.*bind_address='0\.0\.0\.0'.*"
                                      r"DISTRIB_BIND_ADDRESS"):
        ds.Server({"chief": ["c:1"], "ps": [f"203.0.113.7:{port}"]}, "ps", 0, token=TOKEN)


@pytest.mark.parametrize("value", ["", "   ", "host:notaport", "0.0.0.0:70000"])
def test_a_malformed_bind_address_names_the_argument(value):
    with pytest.raises(ValueError, match="bind_address"):
        listen_address("ps-0:2222", value)


def test_a_name_that_is_loopback_here_also_listens_where_the_other_hosts_reach_it():
    """The ps's spec address is `localhost:port` (as a Debian host's own name is 127.0.1.1) while the chief is
    on another host: the server also listens on the local address that routes there, token required."""
    local = routed_address("localhost:1", ["192.0.2.254", "198.51.100.1", "8.8.8.8"])
    if local is None:
        pytest.skip("this machine has no non-loopback route")
    local_host = local.rpartition(":")[0]
    port = free_port()
    server = ds.Server({"chief": [f"{local_host.strip('[]')}:1"], "ps": [f"localhost:{port}"]}, "ps", 0, token=TOKEN)
    try:
        assert server.bind_address == f"localhost:{port}" and server.also_listening == [f"{local_host}:{port}"]
        for target in (f"127.0.0.1:{port}", f"{local_host}:{port}"):
            assert probe(target) == grpc.StatusCode.UNAUTHENTICATED, target  # listening there, and guarded
        assert wire.decode(rpc.Connection(f"{local_host}:{port}", rpc.PS_SERVICE, TOKEN).call(
            "Health", wire.encode({}), timeout=20))["ok"]
    finally:
        server.stop(grace=0)
    # a routable spec address, or every task on this host: nothing more
    assert ds.Server({"chief": ["localhost:1"], "ps": [f"localhost:{port}"]}, "ps", 0, token=TOKEN,
                     start=False).also_listening == []
    assert ds.Server({"chief": ["localhost:1"], "ps": [f"localhost:{port}"]}, "ps", 0, token=TOKEN,
                     bind_address="0.0.0.0", start=False).also_listening == []
