"""Who a network caller is, as the store may see it: a keyed hash of its credentials, never the credentials.

The doors that face a network (the MCP guards over streamable HTTP, the proxy's ``--listen``) scope each
caller's records by the authenticated principal: the access token's (client id, issuer, subject) where
the server has auth, else the ``Authorization`` header as sent. Both are hashed with HMAC-SHA256 under a
secret kept in the ledger's store (made on first use by one conditional write, so that every process
hashes alike), so the store, the logs and the dashboard never hold a credential, and a digest cannot be
matched against guessed credentials without the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any

from onceonly import states as st
from onceonly.errors import StoreCorrupt
from onceonly.states import State
from onceonly.stores.base import Store

__all__ = ["CallerHasher", "check_secret", "stored_secret"]

#: The shortest secret: 128 bits.
MIN_SECRET = 16
_HOST = socket.gethostname()
_lock = threading.Lock()
# The via of a secret record: the server middleware writes the same (its table row is in docs/reference.md).
_MADE = "made"


def check_secret(secret: object, what: str = "client_secret=") -> bytes:
    """``secret`` as bytes if it can key the hash (bytes or text, 16 bytes or more), else an error."""
    if isinstance(secret, str):
        secret = secret.encode("utf-8", "surrogatepass")
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"{what}{type(secret).__name__}: give bytes or text, 16 bytes or more")
    if len(secret) < MIN_SECRET:
        raise ValueError(
            f"{what} has {len(secret)} bytes: give {MIN_SECRET} bytes or more (such as secrets.token_hex(32)), "
            "the same in every server process"
        )
    return bytes(secret)


class CallerHasher:
    """The 128-bit hex digest of a caller's identity, keyed by one secret."""

    __slots__ = ("_mac",)

    def __init__(self, secret: bytes) -> None:
        self._mac = hmac.new(check_secret(secret), digestmod=hashlib.sha256)

    def __call__(self, kind: str, parts: Sequence[Any]) -> str:
        mac = self._mac.copy()
        # The kind and a JSON array: a token's parts can never spell a header's text, or the reverse.
        mac.update(json.dumps([kind, *parts], separators=(",", ":")).encode("utf-8", "surrogatepass"))
        return mac.hexdigest()[:32]


def stored_secret(store: Store, *, key: str, scope: str, tool: str, now: float) -> bytes:
    """The secret kept in ``store`` under ``key``, made on first use: one conditional write, so that
    processes starting together keep the first one written and hash every caller alike.

    Raises:
        StoreCorrupt: the record under ``key`` holds no secret (written by something else).
    """
    owner = f"{_HOST}:{os.getpid()}:secret"
    made = st.new_record(
        key=key, scope=scope, tool=tool, fingerprint=st.SECRET_FINGERPRINT, args_json="{}", state=State.IN_FLIGHT,
        owner=owner, now=now, lease_seconds=0.0, reason="client secret",
    )  # fmt: skip
    made = st.confirm(
        made, result_json=json.dumps({"client_secret": secrets.token_hex(32)}), now=now, ttl=None, via=_MADE, by=owner
    )
    with _lock:
        kept = store.claim(made) or made
    try:
        return check_secret(bytes.fromhex(json.loads(kept.result_json or "")["client_secret"]))
    except (ValueError, TypeError, KeyError) as exc:
        raise StoreCorrupt(
            f"{key} holds no client secret ({exc}): it was written by something else. Nothing was changed: "
            "delete that record (a new secret is then made) or pass client_secret="
        ) from exc
