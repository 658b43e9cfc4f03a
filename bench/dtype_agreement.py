"""How far the engine's greedy output in another dtype (bf16 by default) agrees with its float32 output.

Run from the repository root:

    .venv/bin/python bench/dtype_agreement.py [--dtype bfloat16] [--max-tokens 64] [--device cpu]

Both runs take the same prompts (bench/stack.py's, rendered by the model's chat template), greedy, `ignore_eos`, all
in one batch. For each prompt the table gives the tokens both runs share before they first differ; then how many
prompts agree to the end and the share of all tokens inside the common prefixes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import table  # noqa: E402
from bench.stack import PROMPTS  # noqa: E402
from chatq.core.chat_request import ChatCompletionRequest  # noqa: E402
from chatq.core.model_info import ModelInfo  # noqa: E402
from chatq.core.render import Renderer  # noqa: E402
from chatq.core.settings import Settings  # noqa: E402
from chatq.worker.engine import Engine, Sequence  # noqa: E402
from chatq.worker.model import ensure_model_dir, load_model  # noqa: E402
from chatq.worker.sampler import SamplingParams  # noqa: E402


def generate(settings: Settings, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = load_model(settings)
    engine = Engine(model, kv_tokens=32768, block_size=16, prefill_chunk=512, max_model_len=8192)
    for i, ids in enumerate(prompts):
        engine.add(Sequence(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0)))
    done: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finish:
                done[out.seq.id] = out.seq.output_ids
    return [done[str(i)] for i in range(len(prompts))]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    base = Settings(device=args.device)
    info = ModelInfo.read(base.model_name, ensure_model_dir(base), base.max_model_len)
    renderer = Renderer(info)
    prompts = [renderer.render(ChatCompletionRequest(messages=[{"role": "user", "content": p}])).ids for p in PROMPTS]
    reference = generate(base.model_copy(update={"dtype": "float32"}), prompts, args.max_tokens)
    other = generate(base.model_copy(update={"dtype": args.dtype}), prompts, args.max_tokens)

    shared = [common_prefix(a, b) for a, b in zip(reference, other, strict=True)]
    rows = [[i, n, len(reference[i])] for i, n in enumerate(shared)]
    print(table(["prompt", f"tokens equal before the first difference ({args.dtype} vs float32)", "of"], rows))
    whole = sum(n == len(r) for n, r in zip(shared, reference, strict=True))
    share = sum(shared) / sum(len(r) for r in reference)
    print(f"\n{whole} of {len(prompts)} prompts agree to the end; {share:.0%} of tokens lie in the common prefixes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
