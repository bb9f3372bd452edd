"""CurveZMQ on the data plane: node key pairs, the keyring a role process keeps, ZAP membership checks, handshake diagnosis."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from gossamer.core.errors import AuthError, ConfigError

__all__ = [
    "CurveKeyPair",
    "CurveKeyring",
    "HandshakeMonitor",
    "MembershipAuthenticator",
    "check_public_key",
    "install",
    "installed",
    "keyring_from_spec",
    "peer_key",
]

logger = logging.getLogger(__name__)

#: Keys in a role process's spec (and in the assignment updates the agent pipes to it).
SPEC_PUBLIC, SPEC_SECRET = "curve_public", "curve_secret"
SPEC_SERVER_KEYS, SPEC_MEMBERS, SPEC_SENDERS = "curve_server_keys", "curve_members", "curve_senders"

_Z85_KEY_LEN = 40


def check_public_key(key: str | bytes, field_name: str = "curve_public_key") -> str:
    """A z85-encoded 32-byte CURVE public key, as str; anything else raises ConfigError."""
    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    if not isinstance(text, str) or len(text) != _Z85_KEY_LEN:
        raise ConfigError(field_name, f"must be a {_Z85_KEY_LEN}-character z85 CURVE key")
    try:
        raw = z85.decode(text.encode("ascii"))
    except (ValueError, KeyError, UnicodeEncodeError, TypeError):
        raise ConfigError(field_name, "is not valid z85") from None
    if len(raw) != 32:
        raise ConfigError(field_name, "must decode to 32 bytes")
    return text


@dataclass(frozen=True)
class CurveKeyPair:
    """A node's data-plane identity: z85 public and secret key.

    Each node agent generates its own pair at start: the secret never leaves the node (not
    on the wire, not in the coordinator's state); the coordinator only learns and hands out
    public keys.
    """

    public: str
    secret: str = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeyPair:
        """Raises ConfigError if this libzmq was built without CURVE (libsodium)."""
        if not zmq.has("curve"):
            raise ConfigError("curve", "this pyzmq/libzmq was built without CURVE support")
        public, secret = zmq.curve_keypair()
        return cls(public=public.decode("ascii"), secret=secret.decode("ascii"))


def peer_key(frame: zmq.Frame) -> str | None:
    """The CURVE public key (z85) a received message was authenticated with, if any.

    Our ZAP handler answers with the client's z85 key as User-Id, and libzmq attaches it
    to every message of that connection.
    """
    try:
        key = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return key if isinstance(key, str) else None


@dataclass(frozen=True)
class _Keys:
    """What the coordinator last said, replaced whole so other threads read one consistent view."""

    server_keys: Mapping[str, str] = field(default_factory=dict)
    members: frozenset[str] = frozenset()
    senders: Mapping[str, str] = field(default_factory=dict)


class CurveKeyring:
    """What one process needs for CURVE: its node's key pair, the public key of every
    server endpoint it may connect to, the member keys its own servers accept, and which
    key may speak as each data-plane sender id.

    The coordinator sends the last three with every assignment; `update` replaces them
    whole (one view), so other threads (ZAP handlers, I/O loops) read them without a lock.
    """

    def __init__(
        self,
        keypair: CurveKeyPair,
        *,
        server_keys: Mapping[str, str] | None = None,
        members: Iterable[str] = (),
        senders: Mapping[str, str] | None = None,
    ) -> None:
        self.keypair = keypair
        self._keys = _Keys(dict(server_keys or {}), frozenset(members), dict(senders or {}))

    @property
    def members(self) -> frozenset[str]:
        """Public keys of the experiment's current members (accepted as clients)."""
        return self._keys.members

    def is_member(self, key: str | None) -> bool:
        return key is not None and key in self._keys.members

    def server_key(self, endpoint: str) -> str | None:
        return self._keys.server_keys.get(endpoint)

    def speaks_for(self, key: str | None, sender: str) -> bool:
        """Whether a message authenticated with CURVE key `key` may name `sender` as its sender:
        the coordinator bound `sender` to that key (`curve_senders`). A sender bound to no key is
        refused, except while the coordinator has bound none at all (a server run without one)."""
        senders = self._keys.senders
        if not senders:
            return True
        return key is not None and senders.get(sender) == key

    def update(
        self, *, server_keys: Mapping[str, str] | None = None, members: Iterable[str] | None = None,
        senders: Mapping[str, str] | None = None,
    ) -> None:
        old = self._keys
        self._keys = _Keys(
            dict(server_keys) if server_keys is not None else old.server_keys,
            frozenset(members) if members is not None else old.members,
            dict(senders) if senders is not None else old.senders,
        )

    def update_from(self, update: Mapping[str, Any]) -> None:
        """Take the key fields of an assignment update (the agent's `_update_of`)."""
        self.update(server_keys=update.get(SPEC_SERVER_KEYS), members=update.get(SPEC_MEMBERS),
                    senders=update.get(SPEC_SENDERS))

    # -- sockets ------------------------------------------------------------------------
    def secure_server(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server with this node's key pair (before it binds)."""
        sock.curve_secretkey = self.keypair.secret.encode("ascii")
        sock.curve_publickey = self.keypair.public.encode("ascii")
        sock.curve_server = True

    def secure_client(self, sock: zmq.Socket, endpoint: str) -> None:
        """Make `sock` a CURVE client of the server at `endpoint` (before it connects).

        Raises:
            AuthError: the coordinator named no public key for `endpoint`.
        """
        server = self._keys.server_keys.get(endpoint)
        if server is None:
            raise AuthError(f"no CURVE server key for {endpoint}: the coordinator did not name this endpoint")
        sock.curve_secretkey = self.keypair.secret.encode("ascii")
        sock.curve_publickey = self.keypair.public.encode("ascii")
        sock.curve_serverkey = server.encode("ascii")

    def authenticator(self, ctx: zmq.Context) -> MembershipAuthenticator:
        """Start the ZAP handler of `ctx`: CURVE clients are accepted while they are members."""
        return MembershipAuthenticator(ctx, self)


class MembershipAuthenticator:
    """The ZAP handler of one ZMQ context (pyzmq's ThreadAuthenticator): a CURVE handshake
    succeeds only for a key of the keyring's current members; `refused` counts the others.

    ZAP runs once per connection; servers also check `peer_key` of every message against
    the members, so a node removed from the experiment is refused on a connection it
    already had.
    """

    def __init__(self, ctx: zmq.Context, keyring: CurveKeyring) -> None:
        self.keyring = keyring
        self.refused = 0
        self._lock = threading.Lock()
        from zmq.auth.thread import ThreadAuthenticator  # asyncio inside: only where CURVE is on

        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: `key` is the client's z85 public key."""
        text = key.decode("ascii", "replace")
        if self.keyring.is_member(text):
            return True
        with self._lock:
            self.refused += 1
            first = self.refused == 1
        (logger.warning if first else logger.debug)(
            "refused a CURVE handshake from a non-member key %s", text
        )
        return False

    def stop(self) -> None:
        """Stop the handler thread (before the context is terminated)."""
        self._auth.stop()


_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)


def _describe(event: int, value: int, curve: bool) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"the server refused this node's CURVE key (ZAP status {value}): this node is not, or no "
            "longer, a member of the experiment, or has the wrong key (ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (
                "one side uses CURVE and the other plaintext: check that the node and the coordinator "
                "agree on --curve (ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL, mechanism mismatch)"
            )
        return f"handshake protocol error {value:#x} (ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL)"
    if not curve:
        return (
            "the server hung up during the handshake and this socket is plaintext: most likely one side "
            "uses CURVE and the other plaintext (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)"
        )
    return (
        "the server hung up during the handshake: most likely the wrong CURVE server key for this "
        "endpoint, or a plaintext server (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)"
    )


class HandshakeMonitor:
    """Watches the handshakes of one client socket (a ZMQ socket monitor).

    With CURVE a refused client receives nothing at all; this is how it learns why. After an
    AUTH or PROTOCOL failure libzmq gives up on the connection for good (`fatal`): the owner
    must open a new socket to try again (e.g. once the server has heard of its key).
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._curve = sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        self.socket: zmq.Socket = sock.get_monitor_socket(events=_HANDSHAKE_EVENTS)
        self.failure: str | None = None  # why the last handshake failed; None after a success
        self.fatal = False
        self.succeeded = False  # a handshake completed on this socket
        self.dropped = 0  # connections lost after a completed handshake

    def check(self) -> str | None:
        """Read the pending events (never blocks); returns the current failure, if any."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return self.failure
            except zmq.ZMQError:
                return self.failure
            event = parse_monitor_message(frames)
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded, self.failure, self.fatal = True, None, False
            elif kind == zmq.EVENT_DISCONNECTED:
                if self.succeeded and self.failure is None:
                    self.dropped += 1
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self.fatal:
                pass  # the server hung up after refusing us: the refusal says more
            else:
                self.failure = _describe(kind, value, self._curve)
                self.fatal = kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)

    def close(self) -> None:
        """Stop monitoring (before the watched socket is closed)."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(linger=0)


def keyring_from_spec(spec: Mapping[str, Any]) -> CurveKeyring | None:
    """The keyring of a role process from the spec its agent started it with (None: plaintext)."""
    public, secret = spec.get(SPEC_PUBLIC), spec.get(SPEC_SECRET)
    if not public or not secret:
        return None
    return CurveKeyring(
        CurveKeyPair(public=public, secret=secret),
        server_keys=spec.get(SPEC_SERVER_KEYS) or {},
        members=spec.get(SPEC_MEMBERS) or (),
        senders=spec.get(SPEC_SENDERS) or {},
    )


_installed: CurveKeyring | None = None


def install(keyring: CurveKeyring | None) -> None:
    """Make `keyring` this process's default: ShardClients and PushSumPeers created without
    an explicit one secure their sockets with it. A worker role process installs its node's
    keyring once at start and keeps it current with every assignment update."""
    global _installed
    _installed = keyring


def installed() -> CurveKeyring | None:
    """The keyring `install` set (None: this process talks plaintext)."""
    return _installed
