"""Assembles a worker's pieces from the settings: model, KV cache size, engine, runner."""

from __future__ import annotations

import logging

import redis
import torch

from chatq.core.model_info import ModelInfo
from chatq.core.settings import Settings
from chatq.worker.engine import Engine
from chatq.worker.forward import KVCache
from chatq.worker.grammar import GrammarCompiler, warm_up_masks
from chatq.worker.model import ensure_model_dir, load_model
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
        # On CPU the cache shares RAM with everything else: 64 full-length sequences, or 2 GiB, whichever is less.
        budget = min(2 << 30, 64 * max_model_len * per_token)
    return max(budget // per_token, max_model_len)


def build_runner(settings: Settings, client: redis.Redis, worker: str) -> Runner:
    """The runner of the worker named `worker` (the name its claims record, where cancels find it)."""
    path = ensure_model_dir(settings)
    model = ModelInfo.read(settings.model_name, path, settings.max_model_len)

    def make_engine() -> Engine:
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
        )
        if on_cuda:
            try:
                warm_up_masks(model.vocab_size, engine.device)
            except Exception:  # constrained requests still work, the first ones only start slower
                log.exception("compiling the grammar mask kernel failed")
        log.info("engine ready: %s on %s, %d KV cache tokens", path.name, engine.device, kv_tokens)
        return engine

    compiler = GrammarCompiler(model.tokenizer, model.vocab_size, eos_token_ids=model.eos_token_ids)
    return Runner(make_engine, model, Publisher(client, settings, worker), settings=settings, compiler=compiler)
