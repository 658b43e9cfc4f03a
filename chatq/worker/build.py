"""Assembles a worker's pieces from the settings: model, KV cache size, engine, runner."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import redis
import torch

from chatq.core.render import Renderer
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
    config = json.loads((path / "config.json").read_text())
    max_model_len = settings.max_model_len or int(config["max_position_embeddings"])

    def make_engine() -> Engine:
        model = load_model(settings)
        kv_tokens = kv_cache_tokens(settings, model, max_model_len)
        on_cuda = next(model.parameters()).device.type == "cuda"
        engine = Engine(
            model,
            kv_tokens=kv_tokens,
            block_size=settings.kv_block_size,
            prefill_chunk=settings.prefill_chunk,
            max_model_len=max_model_len,
            graph_batch=settings.cuda_graph_batch if on_cuda else 0,
        )
        if on_cuda:
            try:
                warm_up_masks(int(config["vocab_size"]), engine.device)
            except Exception:  # constrained requests still work, the first ones only start slower
                log.exception("compiling the grammar mask kernel failed")
        log.info("engine ready: %s on %s, %d KV cache tokens", path.name, engine.device, kv_tokens)
        return engine

    renderer = Renderer(path)
    compiler = GrammarCompiler(path, int(config["vocab_size"]), eos_token_ids=renderer.eos_token_ids)
    return Runner(
        make_engine,
        renderer.tokenizer,
        renderer.eos_token_ids,
        Publisher(client, settings, worker),
        max_model_len,
        settings=settings,
        compiler=compiler,
        defaults=generation_defaults(path),
    )


def generation_defaults(path: Path) -> dict:
    """The sampling settings the model's authors recommend (those vLLM reads), used when a request leaves them out."""
    gen = path / "generation_config.json"
    config = json.loads(gen.read_text()) if gen.exists() else {}
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: config[k] for k in names if config.get(k) is not None}
