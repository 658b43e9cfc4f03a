"""A model's registry entry carries what the API needs to serve it, and names its content."""

from __future__ import annotations

import dataclasses

from chatq.core import keys
from chatq.core.registry import entry, read_entry, register
from tests.helpers import model_info


def test_an_entry_reads_back_as_the_model_it_was_written_from():
    info = model_info()
    back, _, digest = read_entry(entry(info) | {"created": "5"})
    assert back == info and digest == entry(info)["digest"]
    text = "Hello <|im_start|>world, naïve ☃"
    assert back.tokenizer.encode(text).ids == info.tokenizer.encode(text).ids


def test_the_digest_changes_with_the_files_the_api_renders_with():
    info = model_info()
    other = dataclasses.replace(info, chat_templates={"default": "{{ messages[0]['content'] }}"})
    assert entry(info)["digest"] == entry(info)["digest"] != entry(other)["digest"]
    assert entry(dataclasses.replace(info, max_model_len=1024))["digest"] != entry(info)["digest"]


def test_registering_again_keeps_the_first_registration_time(r):
    info = dataclasses.replace(model_info(), name="model-registered-twice")
    try:
        register(r, entry(info))
        r.hset(keys.model(info.name), "created", "1000")
        register(r, entry(dataclasses.replace(info, max_model_len=512)))
        back, created, _ = read_entry(r.hgetall(keys.model(info.name)))
        assert created == 1000 and back.max_model_len == 512 and info.name in r.smembers(keys.models())
    finally:
        r.delete(keys.model(info.name))
        r.srem(keys.models(), info.name)
