"""What this host knows of the network: a host name's addresses, the local address that routes to a
peer, and whether an address is loopback.

Two parts ask these questions: gloo's interface choice (:mod:`distrib.comm.interfaces`), and a
parameter server whose own name resolves to loopback (Debian's ``127.0.1.1``) and must also listen
where the other hosts can reach it (:mod:`distrib.parameter_server.server.server`).

Example::

    >>> is_loopback("127.0.1.1"), is_loopback("::1"), is_loopback("10.0.0.2"), is_loopback("node0")
    (True, True, False, False)
    >>> route_source("127.0.0.1")
    '127.0.0.1'
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["is_loopback", "resolve", "route_source"]


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address, with or without an IPv6 zone) is a loopback address; False for names."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to here, in the resolver's order without repeats; [] when it does not."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def route_source(address: str) -> str | None:
    """The local address the kernel picks to reach ``address`` (a UDP ``connect`` sends nothing), or None."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None
