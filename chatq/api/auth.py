"""API keys: who a request is, as a FastAPI dependency of every route but /health, /version, /metrics and the
playground page; and the admin key, of the admin routes.

A request names its key as the openai SDK sends it, `Authorization: Bearer <key>`: one of CHATQ_API_KEYS, or a
managed key (chatq.core.api_keys) that an admin created. Its owner, stored in the records of what it creates, is the
key's SHA-256 in hex: Redis never holds a key, and a job is shown only to the owner that created it.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from chatq.core import api_keys
from chatq.core.api_keys import ApiKey, key_hash
from chatq.core.errors import AdminKeyRequired, AuthenticationFailed
from chatq.core.settings import Settings

log = logging.getLogger(__name__)

OPEN = ""  # the owner of every request when no key is configured


@dataclass(frozen=True)
class Caller:
    owner: str
    key: ApiKey | None = None  # a managed key's record: its name and limits


def _presented(authorization: str | None) -> str:
    """The hash of the key a request sends, or "" for none."""
    scheme, _, key = (authorization or "").partition(" ")
    return key_hash(key.strip()) if scheme.lower() == "bearer" and key.strip() else ""


def _among(presented: str, hashes: list[str]) -> bool:
    """Compares with every hash in constant time, so neither the time nor the order tells how much of a key was
    right."""
    matched = False
    for h in hashes:
        matched |= hmac.compare_digest(presented, h)
    return matched


class Keys:
    """CHATQ_API_KEYS' keys, kept as their hashes, and the managed keys in Redis, each read at most once a second:
    a key revoked or changed is seen so by every API within that second."""

    FRESH_FOR = 1.0
    REMEMBERED = 10_000  # keys looked up, right or wrong, before the memory of them starts afresh

    def __init__(self, settings: Settings, client: aioredis.Redis):
        self.hashes = [key_hash(k) for k in settings.api_key_list]
        admin = settings.admin_key.get_secret_value()
        self.admin = [key_hash(admin)] if admin else []
        self.client = client
        self._seen: dict[str, tuple[float, ApiKey | None]] = {}

    @property
    def open(self) -> bool:
        """No key configured and none to manage: every request is served, as OPEN."""
        return not self.hashes and not self.admin

    def warn_if_open(self) -> None:
        if self.open:
            log.warning("CHATQ_API_KEYS and CHATQ_ADMIN_KEY are empty: the API is open to anyone who can reach it")

    async def caller(self, authorization: str | None) -> Caller:
        """Who sends a request with this Authorization header; raises AuthenticationFailed for a missing, wrong,
        revoked or expired key."""
        if self.open:
            return Caller(OPEN)
        presented = _presented(authorization)
        if not presented:
            raise AuthenticationFailed()
        if _among(presented, self.hashes):
            return Caller(presented)
        key = await self._managed(presented)
        if key is None or key.expired(time.time()):
            raise AuthenticationFailed()
        return Caller(presented, key)

    def is_admin(self, authorization: str | None) -> bool:
        return bool(self.admin) and _among(_presented(authorization), self.admin)

    def check_admin(self, authorization: str | None) -> None:
        if not self.is_admin(authorization):
            raise AdminKeyRequired()

    async def _managed(self, presented: str) -> ApiKey | None:
        now = time.monotonic()
        seen = self._seen.get(presented)
        if seen is not None and now - seen[0] < self.FRESH_FOR:
            return seen[1]
        key = await api_keys.by_hash(self.client, presented)
        if len(self._seen) >= self.REMEMBERED:
            self._seen = {}
        self._seen[presented] = (now, key)
        return key


async def authenticate(request: Request) -> Caller:
    """Who sends the request (see Keys.caller). Async, so FastAPI runs it on the loop rather than in a thread; once
    per request, however many dependencies name it."""
    keys: Keys = request.app.state.keys
    return await keys.caller(request.headers.get("authorization"))


async def _owner(caller: Annotated[Caller, Depends(authenticate)]) -> str:
    return caller.owner


async def admin(request: Request) -> None:
    keys: Keys = request.app.state.keys
    keys.check_admin(request.headers.get("authorization"))


Owner = Annotated[str, Depends(_owner)]
CallerOf = Annotated[Caller, Depends(authenticate)]
Admin = Depends(admin)
