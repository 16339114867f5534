"""The RPC layer: gRPC unary calls carrying wire messages, authenticated by a cluster token.

No ``.proto`` files: every method is ``bytes -> bytes`` through gRPC's generic
handlers, and the bytes are :mod:`~distrib.parameter_server.transport.wire` messages.

Security, in order of the checks a call meets:

* a server binds only the address its task has in the cluster spec, unless it is asked to
  listen on every interface (``ds.Server(bind_address="0.0.0.0")`` or ``DISTRIB_BIND_ADDRESS``,
  as TF's servers do: behind NAT or a Kubernetes Service), and on the routable address of its host
  when the spec's name resolves there only to loopback (Debian's 127.0.1.1, see
  ``server.routed_address``); the checks below hold either way;
* with TLS (:class:`TLSConfig`, or ``DISTRIB_TLS_CERT``/``DISTRIB_TLS_KEY``/``DISTRIB_TLS_CA``)
  the channel is encrypted, and with a CA file both ends must present certificates it signed;
* every call carries the cluster token (``DISTRIB_CLUSTER_TOKEN``, at least 16 characters)
  in its metadata. The :class:`TokenInterceptor` compares it in constant time from the
  call's headers alone, before gRPC is asked for the request's body: a refused call is
  answered by a *streaming* handler that never iterates its requests, so the body of a
  call without the token is never received into the server's memory, let alone decoded
  or unpickled. Refused calls are answered ``UNAUTHENTICATED`` and logged with the peer;
* a message larger than the cluster's limit (``DISTRIB_MAX_MESSAGE_BYTES``, default
  :data:`DEFAULT_MAX_MESSAGE_BYTES` = 1 GiB) is refused by gRPC itself from the length in its
  frame header (``RESOURCE_EXHAUSTED``), before it is buffered whole. Clients check the
  same limit before sending, and the coordinator refuses to place a shard that could not
  travel in one message (see :func:`max_message_bytes`).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from distrib.parameter_server.errors import AuthenticationError, PeerUnavailableError, RemoteProtocolError

__all__ = [
    "TOKEN_ENV",
    "MAX_MESSAGE_ENV",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MIN_TOKEN_LENGTH",
    "PS_SERVICE",
    "WORKER_SERVICE",
    "TLSConfig",
    "cluster_token",
    "max_message_bytes",
    "make_server",
    "Connection",
    "CallPending",
    "MessageTooLargeError",
    "Handler",
]

TOKEN_ENV = "DISTRIB_CLUSTER_TOKEN"
#: a user-given token shorter than this is refused (``distrib launch`` makes 32 hex characters)
MIN_TOKEN_LENGTH = 16
MAX_MESSAGE_ENV = "DISTRIB_MAX_MESSAGE_BYTES"
#: the largest message a ps or worker task accepts, unless ``DISTRIB_MAX_MESSAGE_BYTES`` says otherwise
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
#: room a message needs beside its largest tensor (header, alignment, other fields)
MESSAGE_MARGIN_BYTES = 1 << 20
_GRPC_MAX = (1 << 31) - 1
#: the gRPC service names of a ps task and of a worker task
PS_SERVICE = "distrib.ParameterServer"
WORKER_SERVICE = "distrib.Worker"
TOKEN_METADATA = "x-distrib-cluster-token"
_TLS_ENV = ("DISTRIB_TLS_CERT", "DISTRIB_TLS_KEY", "DISTRIB_TLS_CA")

log = logging.getLogger("distrib.parameter_server.transport.rpc")

Handler = Callable[[bytes], bytes]

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # A restarted task must be found again within about a second, not after gRPC's 2-minute backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),  # two servers must never share one address
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass(frozen=True)
class TLSConfig:
    """Certificate files for TLS. With ``ca_file`` both ends verify each other (mutual TLS).

    Example::

        >>> tls = TLSConfig(cert_file="task.crt", key_file="task.key", ca_file="cluster-ca.crt")
    """

    cert_file: str
    key_file: str
    ca_file: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TLSConfig | None:
        """``DISTRIB_TLS_CERT``, ``DISTRIB_TLS_KEY`` (both needed) and ``DISTRIB_TLS_CA``; None if unset."""
        env = os.environ if environ is None else environ
        cert, key, ca = (env.get(v) or None for v in _TLS_ENV)
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError("TLS needs both DISTRIB_TLS_CERT and DISTRIB_TLS_KEY; only one of them is set")
        return cls(cert, key, ca)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return read(self.cert_file) or b"", read(self.key_file) or b"", read(self.ca_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


_MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_hex(32))'"


def cluster_token(token: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """``token`` if given, else ``DISTRIB_CLUSTER_TOKEN``; a clear error when neither is set or it is too short.

    Example::

        >>> cluster_token("0123456789abcdef")
        '0123456789abcdef'
        >>> cluster_token("secret")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the cluster token (token=...) has 6 characters; it needs at least 16 ...
    """
    where = "token=..."
    if token is None:
        token = (os.environ if environ is None else environ).get(TOKEN_ENV) or None
        where = TOKEN_ENV
    if not token:
        raise ValueError(
            f"no cluster token: set {TOKEN_ENV} to the same secret on every task of the cluster "
            f"(`distrib launch` makes one per run; to make one yourself: {_MAKE_TOKEN})"
        )
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"the cluster token ({where}) has {len(token)} characters; it needs at least {MIN_TOKEN_LENGTH} "
            f"(a short token can be guessed). Make one with {_MAKE_TOKEN} and give the same one to every task"
        )
    return token


def max_message_bytes(value: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The message size limit: ``value``, else ``DISTRIB_MAX_MESSAGE_BYTES``, else 1 GiB.

    Every task of a cluster must use the same limit (``distrib launch`` passes the
    launcher's environment to all of them). Larger parameters must be partitioned, e.g.
    ``variable_partitioner=ds.partitioners.MaxSizePartitioner(max_shard_bytes=256 << 20)``.

    Example::

        >>> max_message_bytes(environ={"DISTRIB_MAX_MESSAGE_BYTES": "67108864"})
        67108864
    """
    source = "max_message_bytes"
    if value is None:
        text = (os.environ if environ is None else environ).get(MAX_MESSAGE_ENV)
        if not text:
            return DEFAULT_MAX_MESSAGE_BYTES
        source = MAX_MESSAGE_ENV
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"{MAX_MESSAGE_ENV}={text!r} is not a number of bytes (e.g. {1 << 30} for 1 GiB)"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int) or not 2 * MESSAGE_MARGIN_BYTES <= value <= _GRPC_MAX:
        raise ValueError(
            f"{source}={value!r}: the message size limit must be an int of bytes between "
            f"{2 * MESSAGE_MARGIN_BYTES} and {_GRPC_MAX} (gRPC's largest message)"
        )
    return value


class MessageTooLargeError(ValueError):
    """A message would exceed the cluster's size limit; it was not sent."""


class CallPending(TimeoutError):
    """:meth:`Connection.result` was given a timeout and the call has not finished yet."""


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the cluster token, before its handler runs."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        given = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA:
                given = value
                break
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return continuation(handler_call_details)
        method = handler_call_details.method

        def refuse(requests: Any, context: grpc.ServicerContext) -> bytes:
            # a stream handler: gRPC hands it an iterator and reads nothing until it is iterated,
            # which it never is, so the refused request's body is never received into memory
            log.warning("refused %s from %s: %s cluster token", method, context.peer(), "wrong" if given else "missing")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
            return b""  # unreachable: abort raises

        return grpc.stream_unary_rpc_method_handler(refuse)


def make_server(
    address: str,
    service: str,
    handlers: Mapping[str, Handler],
    token: str,
    tls: TLSConfig | None = None,
    max_workers: int = 8,
    max_message: int | None = None,
    also: Sequence[str] = (),
) -> grpc.Server:
    """A started gRPC server on exactly ``address`` (and the addresses in ``also``) whose methods are
    ``service/<name>``.

    ``address`` may be ``0.0.0.0:port`` or ``[::]:port`` (every interface): the token is checked all the same.

    Requests larger than ``max_message`` bytes (default: :func:`max_message_bytes`) are
    refused by gRPC with ``RESOURCE_EXHAUSTED``.
    """
    options = [*_SERVER_OPTIONS, ("grpc.max_receive_message_length", max_message_bytes(max_message))]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"distrib-{service}"),
        interceptors=[TokenInterceptor(token)],
        options=options,
    )

    def wrap(fn: Handler) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        return lambda request, context: fn(request)

    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                service, {name: grpc.unary_unary_rpc_method_handler(wrap(fn)) for name, fn in handlers.items()}
            )
        ]
    )
    for where in (address, *also):
        try:
            port = server.add_secure_port(where, tls.server_credentials()) if tls else server.add_insecure_port(where)
        except RuntimeError as e:
            port = 0
            detail = str(e)
        else:
            detail = ""
        if port == 0:
            raise OSError(
                f"cannot listen on {where!r} (taken by another process, or not an address of this "
                f"host){': ' + detail if detail else ''}; check the cluster spec. Behind NAT or a "
                "Kubernetes Service, where the spec's address is not this host's, listen on every "
                "interface: ds.Server(..., bind_address='0.0.0.0') or DISTRIB_BIND_ADDRESS=0.0.0.0 (the "
                "cluster token is still required)"
            )
    server.start()
    return server


class Connection:
    """A channel to one task; ``call`` sends a message and returns the reply's bytes.

    Transport failures raise ``unavailable(address, detail)`` (a
    :class:`PeerUnavailableError` subclass chosen by the caller), a refused token
    raises :class:`AuthenticationError`.
    """

    def __init__(
        self,
        address: str,
        service: str,
        token: str,
        tls: TLSConfig | None = None,
        task: str | None = None,
        unavailable: type[PeerUnavailableError] = PeerUnavailableError,
        max_message: int | None = None,
    ) -> None:
        self.address = address
        self.task = task
        #: the largest request this connection sends (the peer refuses larger ones)
        self.max_message = max_message_bytes(max_message)
        self._service = service
        self._metadata = ((TOKEN_METADATA, token),)
        self._unavailable = unavailable
        self._channel = (
            grpc.secure_channel(address, tls.channel_credentials(), _CHANNEL_OPTIONS)
            if tls
            else grpc.insecure_channel(address, _CHANNEL_OPTIONS)
        )
        self._methods: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    def _method(self, name: str) -> grpc.UnaryUnaryMultiCallable:
        m = self._methods.get(name)
        if m is None:
            m = self._methods[name] = self._channel.unary_unary(f"/{self._service}/{name}")
        return m

    def _check_size(self, method: str, payload: bytes) -> None:
        if len(payload) > self.max_message:
            raise MessageTooLargeError(
                f"a {method} request to {self.task or self.address} would be {len(payload)} bytes, over the cluster's "
                f"message limit of {self.max_message} bytes ({MAX_MESSAGE_ENV}); it was not sent. Send less per call "
                f"(partition large parameters, capture less in scheduled functions) or raise {MAX_MESSAGE_ENV} on "
                "every task"
            )

    def call(self, method: str, payload: bytes, timeout: float | None = None, wait_for_ready: bool = False) -> bytes:
        self._check_size(method, payload)
        self.bytes_sent += len(payload)
        try:
            reply = self._method(method)(
                payload, timeout=timeout, metadata=self._metadata, wait_for_ready=wait_for_ready
            )
        except grpc.RpcError as e:
            raise self._translate(e) from None
        self.bytes_received += len(reply)
        return reply

    def future(self, method: str, payload: bytes, timeout: float | None = None) -> grpc.Future:
        """Start a call; pass the result to :meth:`result` to get the reply's bytes."""
        self._check_size(method, payload)
        self.bytes_sent += len(payload)
        return self._method(method).future(payload, timeout=timeout, metadata=self._metadata)

    def result(self, fut: grpc.Future, timeout: float | None = None) -> bytes:
        """The reply of a call started by :meth:`future`; :class:`CallPending` if it is not done within ``timeout``."""
        try:
            reply = fut.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CallPending(f"{self.task or self.address}: no reply within {timeout}s") from None
        except grpc.FutureCancelledError:
            raise self._unavailable(self.address, "the call was cancelled", self.task) from None
        except grpc.RpcError as e:
            raise self._translate(e) from None
        self.bytes_received += len(reply)
        return reply

    def cancel(self, fut: grpc.Future) -> None:
        """Give up a call started by :meth:`future` (its reply, if one comes, is dropped)."""
        fut.cancel()

    def _translate(self, e: grpc.RpcError) -> Exception:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return self._unavailable(self.address, details or str(code), self.task)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(
                f"{self.task or self.address} refused the call: {details} (every task "
                "needs the same DISTRIB_CLUSTER_TOKEN)"
            )
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return MessageTooLargeError(
                f"{self.task or self.address} refused the call: {details}. Every task must "
                f"have the same {MAX_MESSAGE_ENV}"
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return RemoteProtocolError(
                f"{self.task or self.address} does not serve {self._service}: is it a "
                "task of the other kind, or another program?"
            )
        return RemoteProtocolError(f"{self.task or self.address} failed: {code}: {details}")

    def close(self) -> None:
        self._channel.close()
