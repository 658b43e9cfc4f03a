"""The engine alone on random-weight models shaped like the anchors (bench/hf_baseline.py builds the same).

Load: 256 requests, prompts of 64-512 random tokens, 256 new tokens each, greedy, no EOS; all submitted at once,
continuous batching decides the rest. Prints a table and writes engine_results.json to $OUT (or /tmp/out).

    python bench/gpu_engine.py                    # qwen0.5b and llama8b on CUDA, bf16
    MODELS=tiny N=16 NEW=8 python bench/gpu_engine.py   # a quick check on CPU

LORAS (default 4): the first model runs again with its requests spread over that many random adapters of rank 16
(engine "chatq+4lora"); 0 leaves it out. GRAPHS (default 256) is the largest decode batch replayed as a CUDA graph;
GRAPHS=0 runs every step eagerly. If
the run fails, the model runs again eagerly; each row says whether its graphs were captured and all its tokens made.

Where vLLM is installed (`import vllm` works), each model runs the same load again through chatq's vLLM engine
(chatq/worker/vllm_engine.py, CHATQ_ENGINE=vllm), on the same weights saved for vLLM to load: extra rows, engine
"vllm". Elsewhere it prints why those rows are missing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatq.core import lora_format  # noqa: E402
from chatq.core.lora_format import LoraSpec  # noqa: E402
from chatq.worker.engine import Engine, Sequence, StepEngine  # noqa: E402
from chatq.worker.forward import KVCache  # noqa: E402
from chatq.worker.lora import Weights, layout_of  # noqa: E402
from chatq.worker.sampler import SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
OUT = Path(os.environ.get("OUT", "/tmp/out"))
N = int(os.environ.get("N", "256"))
NEW = int(os.environ.get("NEW", "256"))
CHUNK = int(os.environ.get("CHUNK", "8192"))
GRAPHS = int(os.environ.get("GRAPHS", "256"))
LORAS = int(os.environ.get("LORAS", "4"))  # the first model again, its requests spread over this many adapters
VLLM = importlib.util.find_spec("vllm") is not None


def config(kind: str):
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
        max_position_embeddings=2048,
    )


def free_memory() -> None:
    # A model and engine can outlive their function in a reference cycle until the collector runs.
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def run(
    engine: StepEngine, prompts: list[list[int]], new: int, loras: list[Weights] | None = None
) -> tuple[float, int, dict[str, list[float]]]:
    """Wall seconds, tokens made, and the seconds of each step, apart for steps with prompt tokens ("prefill")
    and steps of decodes alone ("decode"); every step waits for its sampled ids, so each includes its GPU time.
    `loras`: adapters the requests take in turn."""
    for i, p in enumerate(prompts):
        lora = loras[i % len(loras)] if loras else None
        engine.add(Sequence(str(i), p, SamplingParams(max_tokens=new, temperature=0.0), lora=lora))
    sync()
    t0 = time.perf_counter()
    tokens, steps = 0, {"prefill": [], "decode": []}
    while engine.has_work():
        t, prefilled = time.perf_counter(), engine.stats.prefill_tokens
        tokens += sum(1 for o in engine.step() if o.token is not None)
        kind = "prefill" if engine.stats.prefill_tokens > prefilled else "decode"
        steps[kind].append(time.perf_counter() - t)
    sync()
    return time.perf_counter() - t0, tokens, steps


def warm_up(engine: StepEngine, prompts: list[list[int]]) -> None:
    """Each kind of step once before the clock starts (kernels compile, cuBLAS and the allocator settle): a prompt
    alone, prompts beside decodes (eager), decodes alone (graphs)."""
    for i, p in enumerate(prompts):
        engine.add(Sequence(f"warm-up-{i}", p, SamplingParams(max_tokens=4, temperature=0.0)))
        engine.step()
    while engine.has_work():
        engine.step()


def check_against_transformers(graph_batch: int, dtype: torch.dtype = torch.float32) -> bool | dict[str, str]:
    """Greedy tokens of the engine equal transformers' own forward on a small model, on this device: prompt chunks
    (continuing chunks: in bf16 on CUDA, the flash kernel's lower-right bias) beside decodes, then decode steps of 5, 3
    and 2 sequences (graph buckets 1, 2, 4 when graph_batch=4). True, or each differing sequence's first difference
    with transformers' logit margin there: a margin near the dtype's rounding is a near-tie the two summation orders
    split, a large one a wrong step."""
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config("tiny"), dtype=dtype).eval()
    prompts = [torch.randint(10, 990, (n,)).tolist() for n in (5, 37, 64, 130, 300)]
    lengths = [12, 4, 12, 7, 12]
    engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=50, max_model_len=2048, graph_batch=graph_batch)
    got = {}
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add(Sequence(str(i), p, SamplingParams(max_tokens=n, temperature=0.0)))
    while engine.has_work():
        for o in engine.step():
            if o.finish:
                got[o.seq.id] = o.seq.output_ids
    differences = {}
    with torch.inference_mode():
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
            out = got[str(i)]
            # One pass over the prompt and the engine's tokens: the logits at each position pick the next token.
            logits = model(torch.tensor([p + out], device=DEV)).logits[0, len(p) - 1 : -1].float()
            want = logits.argmax(-1).tolist()
            k = next((k for k, (w, g) in enumerate(zip(want, out, strict=True)) if w != g), None)
            if k is not None:
                margin = float(logits[k, want[k]] - logits[k, out[k]])
                differences[str(i)] = f"token {k}: engine {out[k]}, transformers {want[k]}, margin {margin:.3g}"
            elif len(out) != n:
                differences[str(i)] = f"{len(out)} tokens of {n}"
    return differences or True


def bf16_against_transformers() -> bool | dict[str, str] | str:
    if DEV != "cuda":
        return "cuda only"
    return check_against_transformers(min(GRAPHS, 4), torch.bfloat16)


# Run in a process of its own: the fault ends that process' CUDA context.
_DEVICE_LOST = """
import sys, torch
sys.path.insert(0, ".")
from bench.gpu_engine import Engine, SamplingParams, Sequence, config
from chatq.worker import forward
from chatq.worker.device import DeviceLost
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(config("tiny"), dtype=torch.bfloat16).cuda().eval()
engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=512, max_model_len=2048)
def out_of_bounds(self, b, out=None, stop=None):
    torch.zeros(3, device="cuda")[torch.tensor([5], device="cuda")]
    torch.cuda.synchronize()
forward.PagedForward.__call__ = out_of_bounds
engine.add(Sequence("s", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)))
try:
    print("the step returned:", engine.step())
except DeviceLost as e:
    print("DeviceLost:", str(e).splitlines()[0])
"""


def device_lost_ends_steps() -> str:
    """What an engine step does after a device-side assert: raise DeviceLost (the worker then leaves), not fail its
    sequences and carry on with a dead context."""
    if DEV != "cuda":
        return "cuda only"
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", _DEVICE_LOST], capture_output=True, text=True, timeout=180, cwd=root)
    lines = run.stdout.strip().splitlines() or [run.stderr.strip()[-300:]]
    return lines[-1]


def check_attention_bf16() -> dict[str, float] | str:
    """Largest difference between the paged decode kernel in bf16 and SDPA in float32 on the same values, at the
    head shapes of both models (Triton's interpreter cannot run bf16 dots, so the tests check float16 on CPU)."""
    if DEV != "cuda":
        return "cuda only"
    from chatq.worker import attention

    out = {}
    for heads, kv_heads, head_dim in ((14, 2, 64), (32, 8, 128)):
        torch.manual_seed(0)
        with torch.device(DEV):
            kc = torch.randn(4096 * 16, kv_heads, head_dim, dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            lens = torch.randint(1, 1024, (64,), dtype=torch.int32)
            table = torch.stack([torch.randperm(4096)[:64] for _ in range(64)]).to(torch.int32)
            q = torch.randn(64, heads, head_dim, dtype=torch.bfloat16)
        scale = head_dim**-0.5
        got = attention.decode_paged(q, kc, vc, table, lens, scale, 16).float()
        ctx, mask = attention.gather_context(table, lens, 16)
        want = attention.decode_sdpa(q.float(), kc.float(), vc.float(), ctx, mask, scale)
        out[f"{heads}x{head_dim}"] = round(float((got - want).abs().max()), 4)
    return out


def syncs_per_step() -> dict[str, float] | str:
    """Host syncs per decode step of 8 sequences on a small model, greedy and with every sampling parameter set:
    a step should wait for the GPU once, to read its sampled ids. Counted by torch's sync debug mode."""
    if DEV != "cuda":
        return "cuda only"
    import warnings

    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(config("tiny"), dtype=DT).eval()
    sampled = dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5)
    out = {}
    for name, params in (("greedy", dict(temperature=0.0)), ("sampled", dict(sampled, logit_bias={5: 1.0}, seed=1))):
        engine = Engine(model, kv_tokens=4096, block_size=16, prefill_chunk=512, max_model_len=2048, graph_batch=8)
        for i in range(8):
            prompt = torch.randint(10, 990, (20,)).tolist()
            engine.add(Sequence(f"{name}-{i}", prompt, SamplingParams(max_tokens=30, **params)))  # type: ignore[arg-type]
        for _ in range(3):  # the prefill, then decodes
            engine.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(10):
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out[name] = sum("synchroniz" in str(w.message) for w in caught) / 10
    return out


def prompts_for(cfg) -> tuple[list[list[int]], list[list[int]]]:
    """The timed prompts, and the warm-up's own: the timed ones would otherwise find their prefixes cached."""
    random.seed(0)
    torch.manual_seed(0)
    prompts = [torch.randint(10, cfg.vocab_size - 10, (random.randint(64, 512),)).tolist() for _ in range(N)]
    return prompts, [torch.randint(10, cfg.vocab_size - 10, (n,)).tolist() for n in (64, 200, 512, 100)]


def random_adapters(cfg, count: int, rank: int = 16) -> tuple[LoraSpec, list[Weights]]:
    """`count` adapters of random weights on all seven projections, made in memory."""
    spec = lora_format.spec_of(cfg.to_dict(), max_rank=rank, max_loras=count)
    size = layout_of(spec).size
    return spec, [Weights(f"random-{i}", f"random-{i}", rank, (torch.randn(size) * 0.02).to(DT)) for i in range(count)]


def bench_model(kind: str, graph_batch: int, loras: int = 0) -> dict:
    """`loras`: the requests spread over that many adapters of rank 16."""
    cfg = config(kind)
    spec, made = random_adapters(cfg, loras) if loras else (None, None)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DT).eval()
    per_token = KVCache.bytes_per_token(cfg, DT)
    if DEV == "cuda":
        free, _ = torch.cuda.mem_get_info()
        kv_tokens = int(free * 0.8) // per_token
    else:
        kv_tokens = 64 * 1024
    t = time.perf_counter()
    engine = Engine(
        model,
        kv_tokens=kv_tokens,
        block_size=16,
        prefill_chunk=CHUNK,
        max_model_len=cfg.max_position_embeddings,
        graph_batch=graph_batch,
        lora=spec,
    )
    setup = time.perf_counter() - t
    prompts, warm = prompts_for(cfg)
    warm_up(engine, warm)
    wall, tokens, steps = run(engine, prompts, NEW, made)
    decode = sorted(steps["decode"])
    return dict(
        model=kind,
        engine=f"chatq+{loras}lora" if loras else "chatq",
        device=DEV,
        n_req=N,
        new=NEW,
        gen_tokens=tokens,
        s=round(wall, 2),
        tok_s=round(tokens / wall, 1),
        steps=len(decode) + len(steps["prefill"]),
        prefill_steps=len(steps["prefill"]),
        prefill_s=round(sum(steps["prefill"]), 2),
        decode_s=round(sum(decode), 2),
        decode_step_ms_p50=round(1000 * decode[len(decode) // 2], 2) if decode else None,
        kv_tokens=kv_tokens,
        prefill_chunk=CHUNK,
        graph_batch=graph_batch,
        # Capture failing leaves the engine eager (it logs why), and a failed forward pass ends its sequences early:
        # either would make tok/s describe something else than the row says.
        graphs_captured=engine.graphs is not None,
        # The start check's verdict (chatq.worker.selfcheck), and each check with its numbers.
        mode=engine.mode,
        checks=[str(c) for c in engine.checks],
        # Decode attention through the Triton kernel over the paged cache; false: gathered into SDPA, which syncs.
        paged_kernel=engine.forward.paged,
        complete=tokens == N * NEW,
        setup_s=round(setup, 1),
    )


def bench_vllm(kind: str) -> dict:
    """The same load through chatq's vLLM engine, on the model's random weights (the seed bench_model draws them
    with) saved for vLLM to load; token ids in and out, so no tokenizer."""
    from chatq.worker.vllm_engine import VllmEngine

    cfg = config(kind)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=DT)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        del model
        args = dict(
            model=path,
            skip_tokenizer_init=True,
            dtype=str(DT).removeprefix("torch."),
            max_model_len=cfg.max_position_embeddings,
            max_num_seqs=N,
            max_num_batched_tokens=N + CHUNK,
            enforce_eager=GRAPHS == 0,
        )
        if DEV == "cpu":  # the native engine's cache, not vLLM's share of the RAM
            args["kv_cache_memory_bytes"] = 64 * 1024 * KVCache.bytes_per_token(cfg, DT)
        t = time.perf_counter()
        engine = VllmEngine(args, eos_token_ids=(), max_model_len=cfg.max_position_embeddings)
        setup = time.perf_counter() - t
    prompts, warm = prompts_for(cfg)
    warm_up(engine, warm)
    wall, tokens, steps = run(engine, prompts, NEW)
    decode = sorted(steps["decode"])
    return dict(
        model=kind,
        engine="vllm",
        mode="vllm",
        device=DEV,
        n_req=N,
        new=NEW,
        gen_tokens=tokens,
        s=round(wall, 2),
        tok_s=round(tokens / wall, 1),
        steps=len(decode) + len(steps["prefill"]),
        prefill_steps=len(steps["prefill"]),
        prefill_s=round(sum(steps["prefill"]), 2),
        decode_s=round(sum(decode), 2),
        decode_step_ms_p50=round(1000 * decode[len(decode) // 2], 2) if decode else None,
        complete=tokens == N * NEW,
        setup_s=round(setup, 1),
    )


def main() -> None:
    # No options of its own (the environment variables above set it up): --help prints the description.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    facts = {
        "device": DEV,
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else None,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if DEV == "cuda" else None,
    }
    for graph_batch in sorted({0, min(GRAPHS, 4)}):
        try:
            facts[f"check_against_transformers_graphs{graph_batch}"] = check_against_transformers(graph_batch)
        except Exception as e:  # noqa: BLE001 - a broken path is a result to report, not a reason to stop
            facts[f"check_against_transformers_graphs{graph_batch}"] = f"{type(e).__name__}: {e}"
    checks = [("attention_bf16_max_abs_error", check_attention_bf16), ("syncs_per_step", syncs_per_step)]
    checks += [("check_against_transformers_bf16", bf16_against_transformers), ("device_lost", device_lost_ends_steps)]
    for name, check in checks:
        try:
            facts[name] = check()
        except Exception as e:  # noqa: BLE001
            facts[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(facts), flush=True)
    results = []
    kinds = os.environ.get("MODELS", "qwen0.5b,llama8b").split(",")
    runs = [(kinds[0], 0)] + ([(kinds[0], LORAS)] if LORAS else []) + [(kind, 0) for kind in kinds[1:]]
    for kind, loras in runs:
        row: dict | None = None
        for graph_batch in [GRAPHS, 0] if GRAPHS else [0]:  # a failed run is tried once more, eagerly
            try:
                row = bench_model(kind, graph_batch, loras)
            except Exception as e:  # noqa: BLE001 - the next model still runs
                error = f"{type(e).__name__}: {e}"
                print(json.dumps({"model": kind, "graph_batch": graph_batch, "error": error}), flush=True)
            free_memory()  # outside the except block, whose traceback would keep the failed engine's cache alive
            if row is not None:
                break
        if row is not None:
            results.append(row)
            print(json.dumps(row), flush=True)
            (OUT / "engine_results.json").write_text(json.dumps({"facts": facts, "results": results}, indent=1))
        if VLLM and not loras:
            try:
                row = bench_vllm(kind)
            except Exception as e:  # noqa: BLE001 - the next model still runs
                row = None
                print(json.dumps({"model": kind, "engine": "vllm", "error": f"{type(e).__name__}: {e}"}), flush=True)
            free_memory()
            if row is not None:
                results.append(row)
                print(json.dumps(row), flush=True)
                (OUT / "engine_results.json").write_text(json.dumps({"facts": facts, "results": results}, indent=1))
    if not VLLM:
        print("no vllm rows: vLLM is not installed here (`make setup-vllm`, docs/vllm-engine.md)", flush=True)
    print_table(results)


def print_table(results: list[dict]) -> None:
    head = f"{'model':<10} {'engine':>11} {'requests':>8} {'new':>5} {'mode':>6} {'tokens':>8} {'seconds':>8}"
    print(f"\n{head} {'tok/s':>10} {'prefill s':>10} {'decode s':>9} {'decode step p50 ms':>19}")
    for r in results:
        mode = r.get("mode", "-")
        print(
            f"{r['model']:<10} {r['engine']:>11} {r['n_req']:>8} {r['new']:>5} {mode:>6} {r['gen_tokens']:>8} "
            f"{r['s']:>8} {r['tok_s']:>10} {r['prefill_s']:>10} {r['decode_s']:>9} {r['decode_step_ms_p50']!s:>19}"
        )


if __name__ == "__main__":
    main()
