"""vLLM's routes that load and unload LoRA adapters at run time, served when CHATQ_ALLOW_RUNTIME_LORA_UPDATING is
true (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), to the service's operators: the admin key, a CHATQ_API_KEYS key, or
anyone on an open API; never to a managed key. An adapter loaded here is known to every API and every worker of its
model within a second (chatq.core.adapters)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from chatq.api.auth import Keys
from chatq.api.routes import JSONRoute, Svc, valid_json
from chatq.core import adapters, lora_format
from chatq.core.errors import BadRequest, ModelNotFound, OperatorOnly


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    # The model it adapts, where several are served; the default model (CHATQ_MODEL_NAME) by default.
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is not needed


async def operator(request: Request) -> None:
    keys: Keys = request.app.state.keys
    authorization = request.headers.get("authorization")
    if keys.is_admin(authorization):
        return
    if (await keys.caller(authorization)).key is not None:
        raise OperatorOnly()


router = APIRouter(route_class=JSONRoute, dependencies=[Depends(operator), Depends(valid_json)])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, svc: Svc) -> Any:
    if not body.lora_name or not body.lora_path:
        raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    try:
        served = await svc.models.get(body.base_model_name)
    except ModelNotFound as e:
        raise BadRequest(e.message, "base_model_name") from None
    if served.adapter is not None:
        raise BadRequest(f"The base model '{served.shown_name}' is an adapter itself.", "base_model_name")
    if body.lora_name in svc.models.served:
        raise BadRequest(f"The lora adapter '{body.lora_name}' conflicts with a served base model.", "lora_name")
    config = await svc.models.off_loop(lora_format.check, body.lora_path, served.info.lora, served.name)
    record = adapters.record(body.lora_name, served.name, body.lora_path, config)
    if not await adapters.add(svc.redis, record, replace=body.load_inplace):
        raise BadRequest(
            f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True.",
            "lora_name",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, svc: Svc) -> Any:
    if not body.lora_name:
        raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    await adapters.remove(svc.redis, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
