"""Rendezvous stores: a fresh store for every attempt of a torchrun job (pytorch#135712).

torchrun's agent hosts a TCP store at ``MASTER_ADDR:MASTER_PORT`` and
(``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default) keeps it across restarts and
membership changes, so workers that join it as torch does read the previous attempt's
gloo addresses and fail (``connectFullMesh ... Connection refused``, or hang). distrib
therefore joins through a fresh store for every attempt: rank 0 opens one on a free port
and announces it, with a random nonce, in the agent's store; the other ranks take the
announcement, skip one whose store is dead or whose nonce differs (the previous
attempt's), and wait for the current one (:func:`attempt_store`).
``TORCHELASTIC_RESTART_COUNT`` cannot tell attempts apart: it counts one agent's
restarts, not the job's, and a membership change keeps it.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import time
from collections.abc import Mapping

import torch.distributed as dist

__all__ = ["attempt_store", "connect_store", "tcp_store", "uses_agent_store"]


def uses_agent_store(master_address: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``master_address`` is the store of a torchrun agent that outlives its workers.

    torchrun sets ``TORCHELASTIC_USE_AGENT_STORE=True`` (unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); its agent then hosts the store at
    ``MASTER_ADDR:MASTER_PORT``, and no worker may host one there.

    Example::

        >>> env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
        >>> uses_agent_store("n0:29500", env), uses_agent_store("n0:2222", env)
        (True, False)
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    return master_address == f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"


_ANNOUNCEMENT = "distrib/attempt_store"
_NONCE = "distrib/nonce"


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout=datetime.timedelta(seconds=max(timeout, 0.1)),
        wait_for_workers=False,
        multi_tenant=is_master,
    )


def connect_store(host: str, port: int, world_size: int, deadline: float) -> dist.TCPStore:
    """A client of the store at ``host:port``, connected by ``deadline`` (``time.monotonic()``) or a TimeoutError.

    torch's store client alone overshoots its timeout: when the connect fails (refused: the chief
    has not opened its store yet, or never will) it sleeps an exponential backoff with jitter
    before trying again, and that sleep may end far past the deadline (3.7 s after a 3 s timeout
    was seen). So the address is probed here first, quietly, until something accepts a
    connection, and the client is made only then, with what is left of the deadline.
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("nothing accepted a connection there: the chief has not started, or no host answers")
        try:  # an address where no host answers waits here (ARP, SYN retries), bounded by what is left
            with socket.create_connection((host, port), timeout=remaining):
                break
        except OSError:  # refused (nothing listens yet), unreachable, or this connect's own timeout
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
    return tcp_store(host, port, world_size, False, deadline - time.monotonic())


def _listening(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts connections at ``host:port`` (a quiet probe, unlike a store client's retries)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def attempt_store(host: str, port: int, rank: int, world_size: int, deadline: float, run_id: str) -> dist.Store:
    """A store of this attempt's own, found through the torchrun agent's long-lived store at ``host:port``.

    Rank 0 opens a store on a free port (it listens on every interface; rank 0 runs on
    the host of the agent's store, ``MASTER_ADDR``) and writes ``"port nonce"`` under one
    key of the agent's store, overwriting the previous attempt's. Every other rank reads
    that key until it names a store that answers with the same nonce: an announcement
    left by a previous attempt names a store that died with its rank 0 (refused) or, if
    its port was reused, holds another nonce. Bounded by ``deadline``.
    """
    key = f"{_ANNOUNCEMENT}/{run_id}"
    agent = connect_store(host, port, world_size, deadline)
    if rank == 0:
        own = tcp_store(host, 0, world_size, True, deadline - time.monotonic())
        nonce = secrets.token_hex(8)
        own.set(_NONCE, nonce)
        agent.set(key, f"{own.port} {nonce}")
        return own
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no store of this attempt was announced at {host}:{port} (key {key!r})")
        agent.set_timeout(datetime.timedelta(seconds=remaining))
        announced, nonce = agent.get(key).decode().split()
        if _listening(host, int(announced)):
            try:
                store = tcp_store(host, int(announced), world_size, False, min(5.0, remaining))
                if store.check([_NONCE]) and store.get(_NONCE).decode() == nonce:
                    store.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
                    return store
            except (RuntimeError, ValueError):  # not a store (a reused port), or it died meanwhile
                pass
        time.sleep(0.1)
