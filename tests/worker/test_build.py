"""The worker's assembly from its settings: here, the engine arguments a worker on vLLM's engine starts it with."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from chatq.core.settings import Settings
from chatq.worker.build import vllm_args
from chatq.worker.forward import KVCache
from tests.helpers import model_info

MODEL = model_info()
PER_TOKEN = KVCache.bytes_per_token(AutoConfig.from_pretrained(Settings().model_dir), torch.float32)


def args(**settings) -> dict:
    s = Settings(**settings)
    return vllm_args(s, s.model_dir, MODEL)


def test_chatqs_settings_become_vllms_engine_arguments():
    got = args(worker_concurrency=8, prefill_chunk=256, kv_cache_tokens=1000, reasoning_parser="qwen3")
    assert got["model"] == str(Settings().model_dir) and got["max_model_len"] == MODEL.max_model_len
    assert (got["dtype"], got["max_num_seqs"], got["max_num_batched_tokens"]) == ("float32", 8, 264)
    assert got["kv_cache_memory_bytes"] == 1000 * PER_TOKEN and got["reasoning_parser"] == "qwen3"
    assert got["enable_prefix_caching"] and got["scheduling_policy"] == "priority" and not got["enforce_eager"]
    assert args(fast_path="off")["enforce_eager"] and "reasoning_parser" not in args()


def test_on_a_cpu_the_kv_cache_is_chatqs_engines_not_most_of_the_ram():
    assert args()["kv_cache_memory_bytes"] == min(2 << 30, 64 * MODEL.max_model_len * PER_TOKEN)


def test_chatq_vllm_args_go_over_what_chatq_derives(monkeypatch):
    monkeypatch.setenv("CHATQ_VLLM_ARGS", '{"tensor_parallel_size": 2, "max_num_seqs": 3, "enforce_eager": true}')
    got = args()
    assert (got["tensor_parallel_size"], got["max_num_seqs"], got["enforce_eager"]) == (2, 3, True)


def test_a_gpu_other_than_the_first_visible_one_is_refused_naming_cuda_visible_devices():
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        args(device="cuda:1")
