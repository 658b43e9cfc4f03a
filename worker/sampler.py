"""Per-sequence sampling over a batch of logits: every row keeps its own temperature, top-p, top-k and seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [B, V] float32. Returns one token id per row."""
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.all()):
        return logits.argmax(dim=-1).tolist()
    temps = torch.tensor([max(p.temperature, GREEDY_BELOW) for p in params], device=logits.device)
    scaled = logits / temps[:, None]
    if any(p.top_k > 0 for p in params):
        k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params], device=logits.device)
        kth = scaled.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    # Exponential-race sampling (argmax of p / Exp(1)) equals a multinomial draw and lets seeded rows draw their
    # noise from their own generator, so a seed gives the same text whatever else shares the batch.
    noise = torch.empty_like(probs).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled).tolist()
