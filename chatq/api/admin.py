"""The admin routes: API keys created, listed, changed and revoked at run time (`chatq keys` calls them). Every route
needs the admin key, CHATQ_ADMIN_KEY."""

from __future__ import annotations

import time
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from chatq.api.auth import Admin
from chatq.core import api_keys, usage
from chatq.core.api_keys import ApiKey, Limits
from chatq.core.errors import ApiKeyNotFound, BadRequest, Conflict

Limit = PositiveInt | None
NAME = f"^{api_keys.NAME.pattern}$"
Name = Annotated[str, Path(pattern=NAME)]


class KeyLimits(BaseModel):
    """A key's limits as a request sets them; a field left out keeps its value (on update) or is unlimited."""

    model_config = ConfigDict(extra="forbid")

    rpm: Limit = None
    tpm: Limit = None
    in_flight: Limit = None
    batch_tokens: Limit = None
    weight: float = Field(default=1.0, gt=0, le=1000)
    models: list[str] = Field(default_factory=list, max_length=256)
    expires_at: PositiveInt | None = None


class KeyCreate(KeyLimits):
    name: str = Field(pattern=NAME)


def _client(request: Request) -> aioredis.Redis:
    return request.app.state.service.redis


async def _key(request: Request, name: str) -> ApiKey:
    key = await api_keys.by_name(_client(request), name)
    if key is None:
        raise ApiKeyNotFound(name)
    return key


def _check_expiry(expires_at: int | None) -> None:
    if expires_at is not None and expires_at <= time.time():
        raise BadRequest("expires_at must be in the future (Unix seconds).", "expires_at")


router = APIRouter(prefix="/v1/admin/keys", dependencies=[Admin])


@router.post("")
async def create_key(body: KeyCreate, request: Request) -> Any:
    """The new key, with its secret: the one time it is shown."""
    _check_expiry(body.expires_at)
    secret = api_keys.new_secret()
    fields = body.model_dump(exclude={"name", "expires_at"})
    limits = Limits(**fields | {"models": tuple(body.models)})
    key = ApiKey(
        body.name, api_keys.key_hash(secret), api_keys.redacted(secret), int(time.time()), body.expires_at, limits
    )
    if not await api_keys.create(_client(request), key):
        raise Conflict(f"An API key named '{body.name}' exists already.", "name")
    return key.view() | {"value": secret}


@router.get("")
async def list_keys(request: Request) -> Any:
    return {"object": "list", "data": [k.view() for k in await api_keys.listing(_client(request))]}


@router.get("/{name}")
async def retrieve_key(name: Name, request: Request) -> Any:
    return (await _key(request, name)).view()


@router.post("/{name}")
async def update_key(name: Name, body: KeyLimits, request: Request) -> Any:
    """Changes the fields the body sets (null lifts a limit); every API sees the change within a second."""
    changes = body.model_dump(include=body.model_fields_set)
    if "models" in changes:
        changes["models"] = tuple(changes["models"])
    _check_expiry(changes.get("expires_at"))
    updated = await api_keys.update(_client(request), await _key(request, name), **changes)
    if updated is None:
        raise ApiKeyNotFound(name)
    return updated.view()


@router.get("/{name}/usage")
async def key_usage(name: Name, request: Request, days: int = Query(7, ge=1, le=usage.KEPT_DAYS)) -> Any:
    """The key's requests, input and output tokens per day (UTC) and model, over the last `days` days."""
    key = await _key(request, name)
    return {"object": "list", "name": name, "data": await usage.read(_client(request), key.hash, days, time.time())}


@router.delete("/{name}")
async def revoke_key(name: Name, request: Request) -> Any:
    """Revokes the key: every API refuses it within a second. What it created stays its owner's."""
    if not await api_keys.revoke(_client(request), await _key(request, name)):
        raise ApiKeyNotFound(name)
    return {"object": "api_key.deleted", "name": name, "deleted": True}
