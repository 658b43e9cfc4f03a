# Baseline throughput of plain transformers on one GPU: generate (batch 1 and 64), continuous batching, static cache +
# compile. Random weights, so nothing is downloaded.
# Env: MODELS=qwen0.5b,llama8b  N_CB  CB_NEW  NEW  BUDGET(s)  OUT(dir for results.json).
import gc
import json
import os
import random
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LlamaConfig, Qwen2Config

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
BUDGET = float(os.environ.get("BUDGET", "420"))
MODELS = os.environ.get("MODELS", "qwen0.5b,llama8b").split(",")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
N_CB = int(os.environ.get("N_CB", "256"))
CB_NEW = int(os.environ.get("CB_NEW", "256"))
NEW = int(os.environ.get("NEW", "128"))
res = []


def log(**kw):
    kw["t"] = round(time.time() - T0, 1)
    res.append(kw)
    print(json.dumps(kw), flush=True)
    with open(f"{OUT}/results.json", "w") as f:
        json.dump(res, f, indent=1)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


try:
    import flash_attn

    fa = flash_attn.__version__
except Exception as e:
    fa = f"no ({type(e).__name__})"
log(
    env=dict(
        torch=torch.__version__,
        transformers=transformers.__version__,
        dev=DEV,
        gpu=torch.cuda.get_device_name() if DEV == "cuda" else None,
        flash_attn=fa,
    )
)


def cfg_for(kind):
    if kind == "qwen0.5b":
        return Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        )
    if kind == "llama8b":
        return LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
        )
    return Qwen2Config(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def timed_gen(model, ids, **kw):
    sync()
    t = time.time()
    out = model.generate(ids, **kw)
    sync()
    return out, time.time() - t


def rnd(b, n, V):
    return torch.randint(10, V - 10, (b, n), device=DEV)


for kind in MODELS:
    if time.time() - T0 > BUDGET:
        log(skip=kind)
        break
    cfg = cfg_for(kind)
    t = time.time()
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DT, attn_implementation="sdpa").eval()
    sync()
    nparams = sum(p.numel() for p in model.parameters())
    log(model=kind, params_b=round(nparams / 1e9, 3), init_s=round(time.time() - t, 1))
    V = cfg.vocab_size
    g = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    # warmup
    timed_gen(model, rnd(1, 16, V), max_new_tokens=4, **g)
    # prefill latency (TTFT proxy) bs=1, 512-token prompt
    _, dt = timed_gen(model, rnd(1, 512, V), max_new_tokens=1, **g)
    log(model=kind, test="eager_prefill_512_bs1", ttft_ms=round(dt * 1000, 1))
    for bs in (1, 64):
        _, dt = timed_gen(model, rnd(bs, 128, V), max_new_tokens=NEW, min_new_tokens=NEW, **g)
        log(model=kind, test=f"generate_dynamic_bs{bs}", new=NEW, s=round(dt, 2), tok_s=round(bs * NEW / dt, 1))
    # continuous batching
    random.seed(0)
    inputs = [torch.randint(10, V - 10, (random.randint(64, 512),)).tolist() for _ in range(N_CB)]
    cb_cfgs = [("cb_default", ContinuousBatchingConfig())]
    if os.environ.get("CB_GRAPH", "1") == "1":
        cb_cfgs.append(("cb_cudagraph_forced", ContinuousBatchingConfig(use_cuda_graph=True)))
    for label, cbc in cb_cfgs:
        if time.time() - T0 > BUDGET:
            log(skip=label)
            break
        try:
            gc_ = GenerationConfig(max_new_tokens=CB_NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
            sync()
            t = time.time()
            outs = model.generate_batch(
                inputs, generation_config=gc_, continuous_batching_config=cbc, progress_bar=False
            )
            sync()
            dt = time.time() - t
            ntok = sum(len(o.generated_tokens) for o in outs.values())
            log(
                model=kind,
                test=label,
                n_req=N_CB,
                new=CB_NEW,
                gen_tokens=ntok,
                s=round(dt, 2),
                tok_s=round(ntok / dt, 1),
                cfg=dict(
                    cuda_graph=str(cbc.use_cuda_graph),
                    async_=str(cbc.use_async_batching),
                    blocks=cbc.num_blocks,
                    mbt=cbc.max_batch_tokens,
                    attn=model.config._attn_implementation,
                ),
            )
        except Exception as e:
            log(model=kind, test=label, error=repr(e)[:400])
        model.set_attn_implementation("sdpa")
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    # static cache + auto torch.compile (reduce-overhead) on CUDA
    for bs in (1, 32):
        if time.time() - T0 > BUDGET:
            log(skip=f"static_bs{bs}")
            break
        try:
            ids = rnd(bs, 128, V)
            _, dt1 = timed_gen(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, cache_implementation="static", **g)
            _, dt2 = timed_gen(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, cache_implementation="static", **g)
            log(
                model=kind,
                test=f"generate_static_compiled_bs{bs}",
                first_call_s=round(dt1, 1),
                s=round(dt2, 2),
                tok_s=round(bs * NEW / dt2, 1),
            )
        except Exception as e:
            log(model=kind, test=f"static_bs{bs}", error=repr(e)[:400])
    del model
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
log(done=True)
