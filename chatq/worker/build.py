"""Assembles a worker's pieces from the settings: model, KV cache size, engine (chatq's, or vLLM's), runner."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import redis
import torch

from chatq.core import lora_format
from chatq.core.model_info import ModelInfo
from chatq.core.settings import Settings
from chatq.worker.engine import Engine, StepEngine
from chatq.worker.forward import KVCache
from chatq.worker.grammar import GrammarCompiler, warm_up_masks
from chatq.worker.lora import Library
from chatq.worker.model import ensure_model_dir, load_model, pick_device
from chatq.worker.publish import Publisher
from chatq.worker.runner import Runner

log = logging.getLogger(__name__)


def kv_cache_tokens(settings: Settings, model: torch.nn.Module, max_model_len: int) -> int:
    if settings.kv_cache_tokens:
        return settings.kv_cache_tokens
    param = next(model.parameters())
    per_token = KVCache.bytes_per_token(model.config, param.dtype)
    if param.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(param.device)
        budget = int(free * 0.8)
    else:
        budget = cpu_kv_budget(max_model_len, per_token)
    return max(budget // per_token, max_model_len)


def cpu_kv_budget(max_model_len: int, per_token: int) -> int:
    """Bytes of KV cache on a CPU, which shares RAM with everything else: 64 full-length sequences, or 2 GiB,
    whichever is less."""
    return min(2 << 30, 64 * max_model_len * per_token)


def vllm_args(settings: Settings, path: Path, model: ModelInfo) -> dict[str, Any]:
    """vLLM's engine arguments: those chatq's settings decide, then CHATQ_VLLM_ARGS over them."""
    from transformers import AutoConfig

    device, dtype = pick_device(settings)
    if device.index not in (None, 0):
        raise ValueError(f"CHATQ_DEVICE={settings.device}: vLLM's engine runs on the GPUs CUDA_VISIBLE_DEVICES shows")
    args: dict[str, Any] = {
        "model": str(path),
        "dtype": str(dtype).removeprefix("torch."),
        "max_model_len": model.max_model_len,
        "max_num_seqs": settings.worker_concurrency,
        # A step holds every running sequence's next token and a prompt chunk, as chatq's engine's steps do.
        "max_num_batched_tokens": settings.worker_concurrency + settings.prefill_chunk,
        "enable_prefix_caching": True,
        # Lower priorities first, then first come, as in chatq's engine (the default is first come alone).
        "scheduling_policy": "priority",
        "enforce_eager": settings.fast_path == "off",
        "use_tqdm_on_load": False,  # a progress bar is no log line
    }
    if settings.reasoning_parser:
        args["reasoning_parser"] = settings.reasoning_parser  # its grammar then starts after the thought
    per_token = KVCache.bytes_per_token(AutoConfig.from_pretrained(path), dtype)
    if settings.kv_cache_tokens:
        args["kv_cache_memory_bytes"] = settings.kv_cache_tokens * per_token
    elif device.type == "cpu":  # else vLLM takes 92% of the RAM, as it takes of a GPU's memory
        args["kv_cache_memory_bytes"] = cpu_kv_budget(model.max_model_len, per_token)
    return args | settings.vllm_args


def build_runner(settings: Settings, client: redis.Redis, worker: str) -> Runner:
    """The runner of the worker named `worker` (the name its claims record, where cancels find it)."""
    path = ensure_model_dir(settings)
    model = ModelInfo.read(
        settings.model_name,
        path,
        settings.max_model_len,
        settings.chat_template,
        settings.generation_config,
        settings.override_generation_config,
    )
    library = None
    if settings.enable_lora and settings.engine == "native":
        config = json.loads((path / "config.json").read_text())
        model = dataclasses.replace(model, lora=lora_format.spec_of(config, settings.max_lora_rank, settings.max_loras))
        library = Library(model.lora, pick_device(settings)[1], settings.max_cpu_loras)  # type: ignore[arg-type]

    def make_engine() -> StepEngine:
        if settings.engine == "vllm":
            return make_vllm_engine()
        weights = load_model(settings)
        kv_tokens = kv_cache_tokens(settings, weights, model.max_model_len)
        on_cuda = next(weights.parameters()).device.type == "cuda"
        engine = Engine(
            weights,
            kv_tokens=kv_tokens,
            block_size=settings.kv_block_size,
            prefill_chunk=settings.prefill_chunk,
            max_model_len=model.max_model_len,
            graph_batch=settings.cuda_graph_batch if on_cuda else 0,
            fast_path=settings.fast_path == "auto",
            lora=model.lora,
        )
        if on_cuda:
            try:
                warm_up_masks(model.vocab_size, engine.device)
            except Exception:  # constrained requests still work, the first ones only start slower
                log.exception("compiling the grammar mask kernel failed")
        log.info("engine ready: %s on %s, %d KV cache tokens", path.name, engine.device, kv_tokens)
        return engine

    def make_vllm_engine() -> StepEngine:
        from chatq.worker.vllm_engine import VllmEngine

        engine = VllmEngine(
            vllm_args(settings, path, model), eos_token_ids=model.eos_token_ids, max_model_len=model.max_model_len
        )
        log.info("engine ready: %s on %s, vLLM's", path.name, engine.device)
        return engine

    compiler = GrammarCompiler(model.tokenizer, model.vocab_size, eos_token_ids=model.eos_token_ids)
    publisher = Publisher(client, settings, worker)
    return Runner(make_engine, model, publisher, settings=settings, compiler=compiler, library=library)
