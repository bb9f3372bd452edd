"""Data-plane sender tokens: the proof a worker (or a shard's primary) sends that a sender id is its own."""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["fetch_subject", "fetch_token", "log_subject", "log_token", "new_key", "primary_sender", "token_for", "verify"]


def new_key() -> str:
    """A fresh experiment key (hex); the coordinator keeps it and hands it only to shard hosts."""
    return secrets.token_hex(32)


def token_for(key: str, sender: str) -> str:
    """The token of `sender` under `key`: HMAC-SHA256, so holding one token tells nothing of another's."""
    return hmac.new(bytes.fromhex(key), sender.encode(), hashlib.sha256).hexdigest()


def verify(key: str, sender: str, token: object) -> bool:
    """Whether `token` proves `sender` under `key` (constant-time; a non-string token never does)."""
    return isinstance(token, str) and hmac.compare_digest(token_for(key, sender), token)


def primary_sender(shard: int) -> str:
    """The sender id a shard's primary replicates under (its backup checks the token of this id)."""
    return f"shard-{shard}"


def fetch_subject(experiment: str) -> str:
    """What a checkpoint fetch token proves: its holder may read `experiment`'s shard checkpoints."""
    return f"checkpoint-fetch:{experiment}"


def fetch_token(node_secret: str, experiment: str) -> str:
    """The token, under a node's checkpoint secret, that lets a restoring shard read `experiment`'s files there."""
    return token_for(node_secret, fetch_subject(experiment))


def log_subject(experiment: str) -> str:
    """What a role-log token proves: its holder (the coordinator) may read `experiment`'s role logs on a node.

    Not a fetch token's subject: a restoring shard holding one cannot read the node's logs.
    """
    return f"role-logs:{experiment}"


def log_token(node_secret: str, experiment: str) -> str:
    """The token, under a node's checkpoint secret, that lets the coordinator read `experiment`'s role logs there."""
    return token_for(node_secret, log_subject(experiment))
