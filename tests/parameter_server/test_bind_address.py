"""``ds.Server(bind_address=...)`` (issue 11, item 5): listen on every interface, as TF's servers do, token still required.

Behind NAT or a Kubernetes Service the spec's address is the one the other tasks reach, not an
address of the server's host: listening on it fails. ``bind_address="0.0.0.0"`` (or ``"::"``, or
``DISTRIB_BIND_ADDRESS``) listens on every interface at the task's port; the wildcard listener
must refuse a call without the cluster token exactly as the exact-address one does. The
cross-host run of the same is in tests/cluster/test_two_hosts.py (root only).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import grpc
import pytest
from cluster import netns

import distrib as ds
from distrib.parameter_server.errors import AuthenticationError
from distrib.parameter_server.server.server import listen_address, routed_address
from distrib.parameter_server.transport import rpc, wire

TOKEN = "bind-test-token-0123456789abcdef"
NETNS = netns.unavailable()


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
            channel.unary_unary("/distrib.ParameterServer/Health")(
                wire.encode({}), timeout=20, metadata=metadata, wait_for_ready=True
            )
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
            rpc.Connection(target, rpc.PS_SERVICE, "another-token-0123456789abcdef").call(
                "Health", wire.encode({}), timeout=20
            )
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
    with pytest.raises(
        OSError,
        match=r"cannot listen on '203\.0\.113\.7:\d+'.*bind_address='0\.0\.0\.0'.*"
        r"DISTRIB_BIND_ADDRESS",
    ):
        ds.Server({"chief": ["c:1"], "ps": [f"203.0.113.7:{port}"]}, "ps", 0, token=TOKEN)


@pytest.mark.parametrize("value", ["", "   ", "host:notaport", "0.0.0.0:70000"])
def test_a_malformed_bind_address_names_the_argument(value):
    with pytest.raises(ValueError, match="bind_address"):
        listen_address("ps-0:2222", value)


def listen_also_where_the_other_hosts_reach(other: str) -> str:
    """The body of the next test, on a namespace host: the ps's spec address is `localhost:port` while the chief
    is at ``other`` (another host's address); the server also listens on the local address that routes there
    (a UDP ``connect`` finds it, sending nothing), token required. That address."""
    local = routed_address("localhost:1", [other])
    assert local is not None and not local.startswith("127."), local
    local_host = local.rpartition(":")[0]
    port = free_port()
    server = ds.Server({"chief": [f"{other}:1"], "ps": [f"localhost:{port}"]}, "ps", 0, token=TOKEN)
    try:
        assert server.bind_address == f"localhost:{port}" and server.also_listening == [f"{local_host}:{port}"]
        for target in (f"127.0.0.1:{port}", f"{local_host}:{port}"):
            assert probe(target) == grpc.StatusCode.UNAUTHENTICATED, target  # listening there, and guarded
        assert wire.decode(
            rpc.Connection(f"{local_host}:{port}", rpc.PS_SERVICE, TOKEN).call("Health", wire.encode({}), timeout=20)
        )["ok"]
    finally:
        server.stop(grace=0)
    return local_host


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_a_name_that_is_loopback_here_also_listens_where_the_other_hosts_reach_it():
    """As a Debian host's own name is 127.0.1.1: on host1 of two namespace hosts (`cluster.netns`, root), with the
    chief at host2's address, the ps also listens on host1's address. In a namespace, so that every packet stays
    on this machine (issue 30): on the machine's own network the routed address is its real interface."""
    child = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_bind_address as t; "
        f"print('ALSO LISTENING ON', t.listen_also_where_the_other_hosts_reach(sys.argv[1]))"
    )
    with netns.Hosts(2) as hosts:
        proc = hosts.popen(0, [sys.executable, "-c", child, hosts[1].address], {"PYTHONPATH": ":".join(sys.path)})
        code, out = hosts.wait(proc, timeout=120)
        expected = f"ALSO LISTENING ON {hosts[0].address}"
    assert netns.leftovers() == [], netns.leftovers()
    assert code == 0 and expected in out, out[-4000:]


def test_a_routable_spec_address_or_every_task_on_this_host_listens_nowhere_else():
    port = free_port()
    assert (
        ds.Server(
            {"chief": ["localhost:1"], "ps": [f"localhost:{port}"]}, "ps", 0, token=TOKEN, start=False
        ).also_listening
        == []
    )
    assert (
        ds.Server(
            {"chief": ["localhost:1"], "ps": [f"localhost:{port}"]},
            "ps",
            0,
            token=TOKEN,
            bind_address="0.0.0.0",
            start=False,
        ).also_listening
        == []
    )
