"""API keys: who a request is, as a FastAPI dependency of every route but /health, /version, /metrics and the
playground page.

A request names its key as the openai SDK sends it, `Authorization: Bearer <key>`. Its owner, stored in the records
of the jobs it creates, is the key's SHA-256 in hex: Redis never holds a key, and a job is shown only to the owner
that created it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Annotated

from fastapi import Depends, Request

from chatq.core.errors import AuthenticationFailed
from chatq.core.settings import Settings

log = logging.getLogger(__name__)

OPEN = ""  # the owner of every request when no key is configured


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Keys:
    """The configured keys, kept as their hashes; a request's key is hashed and compared with every one of them in
    constant time, so neither the comparison's time nor its order tells how much of a key was right."""

    def __init__(self, settings: Settings):
        self.hashes = [key_hash(k) for k in settings.api_key_list]

    def warn_if_open(self) -> None:
        if not self.hashes:
            log.warning("CHATQ_API_KEYS is empty: the API is open to anyone who can reach it")

    def owner(self, authorization: str | None) -> str:
        """The owner of a request with this Authorization header; raises AuthenticationFailed for a missing or
        wrong key."""
        if not self.hashes:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        presented = key_hash(key.strip()) if scheme.lower() == "bearer" and key.strip() else ""
        matched = False
        for h in self.hashes:
            matched |= hmac.compare_digest(presented, h)
        if not matched:
            raise AuthenticationFailed()
        return presented


async def authenticate(request: Request) -> str:
    """The request's owner (see Keys.owner). Async, so FastAPI runs it on the loop rather than in a thread."""
    keys: Keys = request.app.state.keys
    return keys.owner(request.headers.get("authorization"))


Owner = Annotated[str, Depends(authenticate)]
