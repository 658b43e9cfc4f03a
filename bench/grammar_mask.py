"""Constrained decoding cost on this CPU: xgrammar vs llguidance, next to one decode step of the real model.

For each grammar kind: compile time (cache off), then a valid output is replayed token by token, timing the mask fill
before every token (first fill separately: llguidance builds its lexer lazily there) and the accept after it. Then
the cost of applying a filled bitmask to float32 logits rows, and one cached decode step of SmolLM2 for scale.

    .venv/bin/python bench/grammar_mask.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance as llg
import llguidance.torch as llgt
import torch
import xgrammar as xgr
from tokenizers import Tokenizer

MODEL_DIR = Path("/root/.cache/chatq/models/SmolLM2-135M-Instruct")
VOCAB = 49152
EOS = 2

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOL_CALLS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in (("get_weather", WEATHER), ("search", SEARCH))
        ]
    },
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "status", "address", "tags"],
    "additionalProperties": False,
}
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
# llguidance's equivalent of xgrammar's any_whitespace=False.
COMPACT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[A-Z][a-z]+ [0-9]{1,3}, [0-9]{4}-[0-9]{2}-[0-9]{2} (AM|PM)"

# (name, kind, spec, a valid output to replay)
CASES: list[tuple[str, str, Any, str]] = [
    (
        "tool_calls",
        "json",
        TOOL_CALLS,
        json.dumps(
            [
                {"name": "get_weather", "parameters": {"city": "Paris, France", "unit": "celsius"}},
                {"name": "search", "parameters": {"query": "best croissants near the Eiffel tower", "limit": 5}},
            ]
        ),
    ),
    (
        "nested_json",
        "json",
        NESTED,
        json.dumps(
            {
                "name": "Ada Lovelace",
                "age": 36,
                "status": "active",
                "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
                "tags": ["mathematician", "writer", "analytical engine"],
                "scores": [9.5, 8.25, 10],
            },
        ),
    ),
    ("regex", "regex", REGEX, "Monday 12, 2024-03-15 PM"),
    ("choice", "choice", CHOICES, "negative"),
    ("lark", "lark", LARK, "(12+3.5)*4-7/(2+1)*100"),
]


def xgr_compile(compiler: xgr.GrammarCompiler, kind: str, spec: Any) -> xgr.CompiledGrammar:
    if kind == "json":
        # As chatq/worker/grammar.py compiles them: compact layout, closed objects.
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    return compiler.compile_lark(spec)


def llg_grammar(kind: str, spec: Any) -> str:
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(spec, overrides=COMPACT)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llg.grammar_from("choice", json.dumps(spec))
    return llg.LLMatcher.grammar_from_lark(spec)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t) * 1e3, out


def per_call_ms(cases: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Milliseconds per call of each case, after one warm-up call."""
    out = {}
    for label, fn in cases.items():
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out[label] = (time.perf_counter() - t) * 1e3 / reps
    return out


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def replay(fill: Callable[[], None], accept: Callable[[int], bool], bitmask: torch.Tensor, ids: list[int]) -> dict:
    """Fill before each token (and before EOS), accept each token. Counts valid tokens the mask wrongly forbade."""
    fills, accepts, misses = [], [], 0
    for tok in [*ids, EOS]:
        ms, _ = timed(fill)
        fills.append(ms)
        misses += not allowed(bitmask, tok)
        ms, ok = timed(lambda tok=tok: accept(tok))
        accepts.append(ms)
        assert ok, f"token {tok} rejected"
    rest = sorted(fills[1:])
    return {
        "first": fills[0],
        "median": statistics.median(rest),
        "p99": rest[min(len(rest) - 1, round(0.99 * (len(rest) - 1)))],
        "accept": statistics.median(accepts),
        "misses": misses,
    }


def bench_engines(tok: Tokenizer) -> list[dict]:
    info = xgr_info(tok)
    # Built like the worker would build them; timed separately below.
    xcomp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    ltok = llg.LLTokenizer(str(MODEL_DIR / "tokenizer.json"), n_vocab=VOCAB, eos_token=EOS)
    rows = []
    for name, kind, spec, text in CASES:
        ids = tok.encode(text, add_special_tokens=False).ids
        mask = xgr.allocate_token_bitmask(1, VOCAB)
        ms, compiled = timed(lambda kind=kind, spec=spec: xgr_compile(xcomp, kind, spec))
        m = xgr.GrammarMatcher(compiled)
        r = replay(lambda m=m, mask=mask: m.fill_next_token_bitmask(mask), m.accept_token, mask, ids)
        assert m.is_terminated()
        rows.append({"case": name, "engine": "xgrammar", "tokens": len(ids), "compile": ms, **r})

        def make(kind: str = kind, spec: Any = spec) -> llg.LLMatcher:
            matcher = llg.LLMatcher(ltok, llg_grammar(kind, spec), log_level=0)
            assert not matcher.is_error(), matcher.get_error()
            return matcher

        ms, lm = timed(make)
        r = replay(lambda lm=lm, mask=mask: llgt.fill_next_token_bitmask(lm, mask), lm.consume_token, mask, ids)
        assert lm.is_stopped()
        rows.append({"case": name, "engine": "llguidance", "tokens": len(ids), "compile": ms, **r})
    return rows


def xgr_info(tok: Tokenizer) -> xgr.TokenizerInfo:
    # What TokenizerInfo.from_huggingface does, without loading transformers: the raw (byte-level) token strings.
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    vocab = [by_id.get(i, "") for i in range(VOCAB)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[EOS])


def bench_batch_fill(tok: Tokenizer, batch: int = 32, reps: int = 50) -> dict[str, float]:
    """One bitmask [B, V/32] filled for B sequences of the nested schema, each stopped at a different point."""
    name, kind, spec, text = CASES[1]
    ids = tok.encode(text, add_special_tokens=False).ids
    cuts = [i * len(ids) // batch for i in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, VOCAB)

    compiled = xgr_compile(xgr.GrammarCompiler(xgr_info(tok), max_threads=2), kind, spec)
    matchers = [xgr.GrammarMatcher(compiled) for _ in cuts]
    for m, cut in zip(matchers, cuts, strict=True):
        assert all(m.accept_token(t) for t in ids[:cut])
    xbatch = xgr.BatchGrammarMatcher(max_threads=2)

    ltok = llg.LLTokenizer(str(MODEL_DIR / "tokenizer.json"), n_vocab=VOCAB, eos_token=EOS)
    lmatchers = [llg.LLMatcher(ltok, llg_grammar(kind, spec), log_level=0) for _ in cuts]
    for lm, cut in zip(lmatchers, cuts, strict=True):
        assert lm.consume_tokens(ids[:cut])
    executor = llg.LLExecutor(num_threads=2)
    lpairs = [(m, i) for i, m in enumerate(lmatchers)]

    def xloop() -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def lloop() -> None:
        for lm, i in lpairs:
            llgt.fill_next_token_bitmask(lm, bitmask, i)

    return per_call_ms(
        {
            "xgrammar loop": xloop,
            "xgrammar BatchGrammarMatcher": lambda: xbatch.batch_fill_next_token_bitmask(matchers, bitmask),
            "llguidance loop": lloop,
            "llguidance LLExecutor": lambda: llgt.fill_next_token_bitmask_par(executor, lpairs, bitmask),
        },
        reps,
    )


def bench_apply(batch: int, rows_masked: int, reps: int = 100) -> dict[str, float]:
    logits = torch.randn(batch, VOCAB)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (VOCAB + 31) // 32), dtype=torch.int32)
    idx = list(range(rows_masked))
    bits = torch.arange(32, dtype=torch.int32)

    def torch_native() -> None:
        keep = (bitmask[idx, :, None] >> bits) & 1
        logits[idx] = logits[idx].masked_fill(keep.view(len(idx), -1)[:, :VOCAB] == 0, float("-inf"))

    return per_call_ms(
        {
            "xgrammar CPU kernel": lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, indices=idx),
            "torch (unpack + masked_fill)": torch_native,
        },
        reps,
    )


def bench_decode() -> dict[int, float]:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for batch in (1, 32):
            # One 200-token prefill, copied to every row: the cost of a step does not depend on the cache contents.
            cache = DynamicCache(config=model.config)
            model(torch.randint(100, 40000, (1, 200)), cache=cache, use_cache=True)
            cache.batch_repeat_interleave(batch)
            step = torch.randint(100, 40000, (batch, 1))
            times = []
            for _ in range(5):
                ms, _ = timed(lambda cache=cache, step=step: model(step, cache=cache, use_cache=True))
                cache.crop(-1)
                times.append(ms)
            out[batch] = statistics.median(times[1:])
    return out


def main() -> None:
    # No options of its own: --help prints the description.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    # Two cores shared with other jobs: more than one thread makes torch's OpenMP spin, ~20x slower steps here.
    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ms, _ = timed(lambda: xgr.GrammarCompiler(xgr_info(tok)))
    ms2, _ = timed(lambda: llg.LLTokenizer(str(MODEL_DIR / "tokenizer.json"), n_vocab=VOCAB, eos_token=EOS))
    print(f"tokenizer setup (once per worker): xgrammar {ms:.0f} ms, llguidance {ms2:.0f} ms")

    print("\nper request: compile (cache off); per token while replaying a valid output: fill the [1, V/32] bitmask")
    print("(first fill apart), accept the token. ms")
    head = f"{'case':<12} {'engine':<11} {'tokens':>6} {'compile':>8} {'1st fill':>9} {'fill p50':>9} {'fill p99':>9}"
    print(head + f" {'accept p50':>10} {'mask misses':>11}")
    for r in bench_engines(tok):
        print(
            f"{r['case']:<12} {r['engine']:<11} {r['tokens']:>6} {r['compile']:>8.2f} {r['first']:>9.3f} "
            f"{r['median']:>9.3f} {r['p99']:>9.3f} {r['accept']:>10.3f} {r['misses']:>11}"
        )

    print("\nfill one bitmask for 32 sequences (nested_json, each at a different point), ms per batch")
    for label, ms in bench_batch_fill(tok).items():
        print(f"  {label:<30} {ms:7.3f}")

    print("\napply a bitmask to float32 logits [B, 49152] in place, ms per call")
    for batch, masked in ((1, 1), (32, 4), (32, 32)):
        for label, ms in bench_apply(batch, masked).items():
            print(f"  B={batch:<3} rows masked={masked:<3} {label:<30} {ms:7.3f}")

    print("\none decode step of SmolLM2-135M (fp32, CPU, 1 thread): 1 new token per row over a 200-token KV cache")
    for batch, ms in bench_decode().items():
        print(f"  B={batch:<3} {ms:8.1f} ms")


if __name__ == "__main__":
    main()
