"""Which network interface gloo (and NCCL) bind to: the one that routes to the chief.

gloo binds to the address this host's name resolves to; Debian's default ``/etc/hosts``
makes that ``127.0.1.1``, which no other host can reach (``connectFullMesh ...
remote=[127.0.1.1]``). Unless ``GLOO_SOCKET_IFNAME`` is set, :func:`configure_interface`
sets it to the interface that routes to the chief (or, on the chief's own host, to
another worker's host), and refuses a cluster across hosts where only loopback routes,
naming ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``. The choice itself,
:func:`choose_interface`, is a pure function of what the host resolves, routes and has,
so it is unit-tested without a network (``tests/cluster/test_interfaces.py``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from distrib.cluster.hosts import is_loopback, resolve, route_source
from distrib.comm.communicator import CollectiveError

__all__ = ["InterfaceChoice", "choose_interface", "configure_interface"]

log = logging.getLogger("distrib.comm")


@dataclass(frozen=True)
class InterfaceChoice:
    """The network interface gloo should bind to (``name``; None: leave gloo's default) and why."""

    name: str | None
    reason: str


def choose_interface(
    chief_host: str,
    peer_hosts: Iterable[str],
    across_hosts: bool | None,
    *,
    resolve: Callable[[str], list[str]],
    route: Callable[[str], str | None],
    interfaces: Mapping[str, Sequence[str]],
) -> InterfaceChoice:
    """The interface this worker's gloo should use to reach the others; a pure function, so it is unit-tested.

    ``resolve(host)`` gives a host's addresses, ``route(address)`` the local address the
    kernel would send from to reach ``address`` (None: no route), ``interfaces`` maps
    each interface name to its addresses. ``across_hosts`` says whether the workers run
    on several hosts (None: judged from the hosts given). The interface chosen is the
    one holding the local address that routes to the chief or, when the chief's name
    resolves to a loopback address here (this is the chief's host, and Debian's
    ``/etc/hosts`` maps its name to ``127.0.1.1``), to another worker's host. A cluster
    across hosts where only loopback routes is a ValueError naming ``GLOO_SOCKET_IFNAME``
    and ``NCCL_SOCKET_IFNAME``, unless this host has exactly one other interface.

    Example (a worker whose route to the chief leaves by ``eth0``)::

        >>> choose_interface("node0", ["node1"], None, resolve=lambda h: {"node0": ["10.0.0.1"]}.get(h, ["127.0.1.1"]),
        ...                  route=lambda a: "10.0.0.2", interfaces={"lo": ["127.0.0.1"], "eth0": ["10.0.0.2"]}).name
        'eth0'
    """

    def resolved(host: str) -> list[str]:
        try:
            return resolve(host)
        except OSError:
            return []

    chief = resolved(chief_host)
    if not chief:
        return InterfaceChoice(None, f"the chief's host {chief_host!r} does not resolve here")
    peers = [h for h in dict.fromkeys(peer_hosts) if h != chief_host]
    if across_hosts is None:
        places = {"loopback" if all(is_loopback(a) for a in resolved(h)) else h for h in [chief_host, *peers]}
        across_hosts = len(places) > 1
    loopback = next((name for name, addresses in interfaces.items() if any(is_loopback(a) for a in addresses)), "lo")
    if not across_hosts and all(is_loopback(a) for a in chief):
        return InterfaceChoice(loopback, f"every worker runs on this host ({chief_host} is a loopback address)")
    for host in [chief_host, *peers]:
        for address in resolved(host):
            local = route(address)
            if local is None or is_loopback(local):
                continue
            name = next((n for n, addresses in interfaces.items() if local in addresses), None)
            if name is not None:
                return InterfaceChoice(name, f"{name} ({local}) routes to {host} ({address})")
    if not across_hosts:
        return InterfaceChoice(loopback, f"every worker runs on this host ({chief_host} resolves to loopback here)")
    others = sorted(
        n for n, addresses in interfaces.items() if addresses and not all(is_loopback(a) for a in addresses)
    )
    if len(others) == 1:
        return InterfaceChoice(
            others[0],
            f"{others[0]} is this host's only non-loopback interface (no route to the other workers was found)",
        )
    raise ValueError(
        f"the workers run on several hosts, but from this host only loopback routes to the chief {chief_host!r} "
        f"({', '.join(chief)}) and to the other workers' hosts ({', '.join(peers) or 'none listed'}): the other "
        f"hosts could not reach this worker. This is usual when this host's name resolves to 127.0.1.1 "
        f"(Debian's /etc/hosts). Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME with NCCL) to the interface "
        f"that reaches the other hosts ({', '.join(others) or 'this host has no other interface'}), or give the "
        f"hosts' routable addresses in the cluster"
    )


def _interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4 (``SIOCGIFADDR``) and IPv6 (``/proc/net/if_inet6``) addresses."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            found[name] = []
            try:
                request = struct.pack("256s", name[:15].encode())
                found[name].append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, request)[20:24]))
            except OSError:
                pass  # no IPv4 address
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    raw = fields[0]
                    found.setdefault(fields[5], []).append(
                        str(ipaddress.IPv6Address(":".join(raw[i : i + 4] for i in range(0, 32, 4))))
                    )
    except OSError:
        pass
    return found


def configure_interface(chief_host: str, hosts: Sequence[str], across_hosts: bool | None, backend: str) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` (and across hosts with NCCL, ``NCCL_SOCKET_IFNAME``) unless the user did."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        choice = choose_interface(
            chief_host, hosts, across_hosts, resolve=resolve, route=route_source, interfaces=_interfaces()
        )
    except ValueError as e:
        raise CollectiveError(str(e)) from None
    if choice.name is None:
        log.info("leaving gloo's interface to its default: %s", choice.reason)
        return
    log.info("gloo uses interface %s: %s", choice.name, choice.reason)
    os.environ["GLOO_SOCKET_IFNAME"] = choice.name
    if backend == "nccl" and not _is_loopback_name(choice.name) and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = choice.name


def _is_loopback_name(name: str) -> bool:
    return name == "lo" or name.startswith("lo:")
