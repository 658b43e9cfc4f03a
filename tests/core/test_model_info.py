"""The served model's facts, as the API and the worker both read them."""

from __future__ import annotations

import json
import shutil

import pytest

from chatq.core.model_info import ModelInfo
from chatq.core.settings import Settings


def test_the_default_models_facts():
    info = ModelInfo.read("SmolLM2-135M-Instruct", Settings().model_dir)
    assert (info.max_model_len, info.vocab_size) == (8192, 49152)
    assert 2 in info.eos_token_ids and info.special_tokens["eos_token"] == "<|im_end|>"
    assert set(info.chat_templates) == {"default"}
    assert ModelInfo.read("m", Settings().model_dir, max_model_len=1024).max_model_len == 1024


def test_a_config_without_a_context_length_needs_one_set_and_the_vocabulary_falls_back_to_the_tokenizer(tmp_path):
    source = Settings().model_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    del config["max_position_embeddings"], config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="CHATQ_MAX_MODEL_LEN"):
        ModelInfo.read("m", tmp_path)
    info = ModelInfo.read("m", tmp_path, max_model_len=2048)
    assert info.max_model_len == 2048
    assert info.vocab_size == info.tokenizer.get_vocab_size(with_added_tokens=True)
