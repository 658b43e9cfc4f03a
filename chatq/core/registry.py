"""The model registry: each worker writes what the API needs to serve its model (the model's limits, tokenizer and chat
templates) into Redis, so an API serves every model that has a live worker, started before it or after, with no model
files of its own."""

from __future__ import annotations

import hashlib
import time

import redis
from pydantic import BaseModel
from tokenizers import Tokenizer

from chatq.core import keys
from chatq.core.lora_format import LoraSpec
from chatq.core.model_info import ModelInfo

OWNED_BY = "chatq"


class ModelRecord(BaseModel):
    """A model's entry, as stored in its hash's `record` field; its tokenizer's JSON sits beside it, in `tokenizer`."""

    name: str
    max_model_len: int
    vocab_size: int
    chat_templates: dict[str, str]
    special_tokens: dict[str, str | None]
    eos_token_ids: list[int]
    sampling_defaults: dict[str, int | float]  # int: top_k, max_tokens
    lora: LoraSpec | None = None

    @classmethod
    def of(cls, info: ModelInfo) -> ModelRecord:
        return cls(
            name=info.name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            chat_templates=info.chat_templates,
            special_tokens=info.special_tokens,
            eos_token_ids=list(info.eos_token_ids),
            sampling_defaults=info.sampling_defaults,
            lora=info.lora,
        )

    def info(self, tokenizer: Tokenizer) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            chat_templates=self.chat_templates,
            special_tokens=self.special_tokens,
            eos_token_ids=tuple(self.eos_token_ids),
            sampling_defaults=self.sampling_defaults,
            tokenizer=tokenizer,
            lora=self.lora,
        )


def entry(info: ModelInfo) -> dict[str, str]:
    """The hash fields that register `info`. `digest` names their content: the API reloads a model only when it
    changes, and a worker finds its entry gone (Redis lost its data) or replaced (another build of the same name)."""
    record, tokenizer = ModelRecord.of(info).model_dump_json(), info.tokenizer.to_str()
    digest = hashlib.sha256(f"{record}\0{tokenizer}".encode()).hexdigest()[:16]
    return {"record": record, "tokenizer": tokenizer, "digest": digest}


def register(client: redis.Redis, fields: dict[str, str]) -> None:
    """Writes a model's entry (from `entry`); its `created` time stays that of its first registration."""
    name = ModelRecord.model_validate_json(fields["record"]).name
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.model(name), mapping=fields)  # type: ignore[arg-type]
    pipe.hsetnx(keys.model(name), "created", str(int(time.time())))
    pipe.sadd(keys.models(), name)
    pipe.execute()


def read_entry(fields: dict[str, str]) -> tuple[ModelInfo, int, str]:
    """A stored entry -> the model's facts, its creation time and digest. Parsing the tokenizer takes a while: the API
    does it off its event loop."""
    info = ModelRecord.model_validate_json(fields["record"]).info(Tokenizer.from_str(fields["tokenizer"]))
    return info, int(fields.get("created") or 0), fields["digest"]
