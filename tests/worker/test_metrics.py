"""The worker's own /metrics, on CHATQ_WORKER_METRICS_PORT: what its engine did for the jobs it ran."""

from __future__ import annotations

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from chatq.core.settings import Settings
from tests.helpers import quiesce

# A prompt longer than a cache block past the chat template's own, so its second run finds blocks to share.
PROMPT = [{"role": "user", "content": "Describe, in a few words, a lighthouse on a rocky shore at night. " * 3}]


def scrape(settings: Settings) -> dict[str, float]:
    resp = httpx.get(f"http://127.0.0.1:{settings.worker_metrics_port}/metrics", timeout=10)
    assert resp.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.labels.get("model_name") == settings.model_name and "le" not in s.labels:
                samples[s.name] = s.value
    return samples


def test_the_worker_reports_its_engines_steps_tokens_cache_and_prefix_hits(
    http: httpx.Client, r: redis.Redis, settings: Settings
):
    quiesce(r, settings)
    before = scrape(settings)
    usages = []
    for _ in range(2):
        resp = http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 5, "temperature": 0})
        assert resp.status_code == 200
        usages.append(resp.json()["usage"])
    after = scrape(settings)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}

    prompts = [u["prompt_tokens"] for u in usages]
    assert delta["chatq:engine_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages)
    # A token per step at most for one sequence: as many steps as tokens, each one timed.
    assert delta["chatq:engine_steps_total"] >= max(u["completion_tokens"] for u in usages)
    assert delta["chatq:engine_step_seconds_count"] >= delta["chatq:engine_steps_total"]
    assert delta["chatq:engine_step_seconds_sum"] > 0
    # The second run of the prompt found the first one's full blocks cached, and computed only the rest.
    shared = (prompts[1] - 1) // 16 * 16
    assert delta["chatq:prefix_cache_queries_total"] == sum(prompts)
    assert shared <= delta["chatq:prefix_cache_hits_total"] <= 2 * shared
    computed = delta["chatq:prefix_cache_queries_total"] - delta["chatq:prefix_cache_hits_total"]
    assert delta["chatq:engine_prefill_tokens_total"] == computed
    blocks = after["chatq:kv_cache_num_blocks"]
    assert blocks > 0 and 0 <= after["chatq:kv_cache_usage_perc"] <= 1
    assert after["chatq:kv_cache_used_blocks"] == pytest.approx(after["chatq:kv_cache_usage_perc"] * blocks)
    assert after["chatq:engine_batch_size"] >= 1
    assert "chatq:num_preemptions_total" in after
    text = httpx.get(f"http://127.0.0.1:{settings.worker_metrics_port}/metrics", timeout=10).text
    families = [f for f in text_string_to_metric_families(text) if f.name == "chatq:engine_mode"]
    assert [(s.labels["mode"], s.value) for f in families for s in f.samples] == [("plain", 1.0)]  # a CPU's path
