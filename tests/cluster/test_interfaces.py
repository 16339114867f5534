"""The choice of gloo's interface (``distrib.comm.interfaces.choose_interface``): a pure function, tested on
made-up hosts, routes and interfaces (no network), plus ``configure_interface``'s respect for the user's
``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import pytest

from distrib.comm import interfaces
from distrib.comm.communicator import CollectiveError
from distrib.comm.interfaces import choose_interface

IFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2"], "docker0": ["172.17.0.1"]}


def resolver(table: dict[str, list[str]]):
    def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    return resolve


def router(table: dict[str, str | None]):
    return lambda address: table.get(address)


def test_the_interface_that_routes_to_the_chief_is_chosen():
    choice = choose_interface(
        "node0",
        ["node0", "node1"],
        None,
        resolve=resolver({"node0": ["10.0.0.1"], "node1": ["10.0.0.2"]}),
        route=router({"10.0.0.1": "10.0.0.2"}),
        interfaces=IFACES,
    )
    assert choice.name == "eth0"
    assert "10.0.0.1" in choice.reason


def test_on_the_chiefs_debian_host_the_route_to_another_worker_chooses():
    """The chief's name is 127.0.1.1 on its own host (Debian's /etc/hosts): the route to node1 decides."""
    choice = choose_interface(
        "node0",
        ["node0", "node1"],
        True,
        resolve=resolver({"node0": ["127.0.1.1"], "node1": ["10.0.0.3"]}),
        route=router({"127.0.1.1": "127.0.0.1", "10.0.0.3": "10.0.0.2"}),
        interfaces=IFACES,
    )
    assert choice.name == "eth0"
    assert "node1" in choice.reason


def test_every_worker_on_loopback_uses_loopback():
    choice = choose_interface(
        "127.0.0.1",
        ["127.0.0.1"],
        None,
        resolve=resolver({"127.0.0.1": ["127.0.0.1"]}),
        route=router({"127.0.0.1": "127.0.0.1"}),
        interfaces=IFACES,
    )
    assert choice.name == "lo"
    assert "every worker runs on this host" in choice.reason


def test_localhost_with_two_names_on_one_host_is_not_across_hosts():
    choice = choose_interface(
        "localhost",
        ["localhost", "127.0.0.1"],
        None,
        resolve=resolver({"localhost": ["127.0.0.1", "::1"], "127.0.0.1": ["127.0.0.1"]}),
        route=router({}),
        interfaces=IFACES,
    )
    assert choice.name == "lo"


def test_loopback_only_across_hosts_is_an_error_naming_the_variables():
    """Two hosts, but every name resolves to loopback here and several interfaces exist: refused, never guessed."""
    with pytest.raises(ValueError) as info:
        choose_interface(
            "node0",
            ["node0", "node1"],
            True,
            resolve=resolver({"node0": ["127.0.1.1"], "node1": ["127.0.1.1"]}),
            route=router({"127.0.1.1": "127.0.0.1"}),
            interfaces=IFACES,
        )
    message = str(info.value)
    assert "GLOO_SOCKET_IFNAME" in message and "NCCL_SOCKET_IFNAME" in message
    assert "127.0.1.1" in message and "docker0" in message and "eth0" in message


def test_loopback_only_across_hosts_with_a_single_other_interface_takes_it():
    choice = choose_interface(
        "node0",
        ["node1"],
        True,
        resolve=resolver({"node0": ["127.0.1.1"], "node1": []}),
        route=router({"127.0.1.1": "127.0.0.1"}),
        interfaces={"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]},
    )
    assert choice.name == "eth0"
    assert "only non-loopback interface" in choice.reason


def test_a_chief_that_does_not_resolve_leaves_glooss_default():
    choice = choose_interface("nowhere", ["node1"], None, resolve=resolver({}), route=router({}), interfaces=IFACES)
    assert choice.name is None
    assert "does not resolve" in choice.reason


def test_a_route_by_an_address_of_no_listed_interface_falls_through_to_the_next_host():
    choice = choose_interface(
        "node0",
        ["node1"],
        True,
        resolve=resolver({"node0": ["10.9.9.9"], "node1": ["172.17.0.5"]}),
        route=router({"10.9.9.9": "10.9.9.1", "172.17.0.5": "172.17.0.1"}),
        interfaces=IFACES,
    )
    assert choice.name == "docker0"


def test_ipv6_routes_choose_their_interface():
    choice = choose_interface(
        "node0",
        [],
        True,
        resolve=resolver({"node0": ["fd00::1"]}),
        route=router({"fd00::1": "fd00::2"}),
        interfaces={"lo": ["127.0.0.1", "::1"], "ens3": ["fd00::2"]},
    )
    assert choice.name == "ens3"


def test_configure_interface_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine0")
    interfaces.configure_interface("node-that-does-not-exist.invalid", ["x"], True, "gloo")
    assert interfaces.os.environ["GLOO_SOCKET_IFNAME"] == "mine0"


def test_configure_interface_on_loopback_sets_gloo_to_loopback(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    interfaces.configure_interface("127.0.0.1", ["127.0.0.1"], False, "nccl")
    name = interfaces.os.environ["GLOO_SOCKET_IFNAME"]
    assert "127.0.0.1" in interfaces._interfaces()[name]
    assert "NCCL_SOCKET_IFNAME" not in interfaces.os.environ  # NCCL on loopback: left to NCCL


def test_configure_interface_turns_the_refusal_into_a_collective_error(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(interfaces, "_interfaces", lambda: IFACES)
    monkeypatch.setattr(interfaces, "resolve", lambda host: ["127.0.1.1"])
    monkeypatch.setattr(interfaces, "route_source", lambda address: "127.0.0.1")
    with pytest.raises(CollectiveError, match="GLOO_SOCKET_IFNAME"):
        interfaces.configure_interface("node0", ["node0", "node1"], True, "gloo")
    assert "GLOO_SOCKET_IFNAME" not in interfaces.os.environ
