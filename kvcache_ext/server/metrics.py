"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per app.

The engine's state (requests running and waiting, KV blocks, prefix hits per tier, prompt tokens
computed and reused) is read from the engine thread's latest snapshot when scraped, so scraping never
touches the Engine; latencies and finished requests are recorded by the HTTP handlers as they happen.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: from a few milliseconds (a tiny model's decode step) to minutes (a long queue).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PREFIX = "kvcache_ext"


class _EngineStateCollector:
    """Renders the engine thread's ``snapshot`` at each scrape."""

    def __init__(self, engine_thread):
        self.engine_thread = engine_thread

    def describe(self):
        return []  # the families are built per scrape: nothing to check at registration

    def collect(self):
        state = self.engine_thread.snapshot
        for name, help_text in [
            ("requests_running", "Requests admitted to the engine and generating."),
            ("requests_waiting", "Requests queued for the engine."),
            ("kv_blocks_used", "KV cache blocks held by requests."),
            ("kv_blocks_free", "KV cache blocks free (cached prefixes not in use count as free)."),
        ]:
            key = name.replace("kv_", "")
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=state[key])
        for name, key, help_text in [
            ("prompt_tokens_computed", "prompt_tokens_computed", "Prompt tokens fed to the model."),
            ("prompt_tokens_reused", "prompt_tokens_reused", "Prompt tokens taken from the prefix cache."),
            ("preemptions", "preemptions", "Requests preempted when the pool ran out."),
            ("steps_failed", "steps_failed", "Engine steps that raised (their requests failed)."),
            ("generation_tokens", "tokens_generated", "Tokens the engine generated."),
        ]:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=state[key])
        hits = CounterMetricFamily(
            f"{PREFIX}_prefix_hits", "Prompt blocks found in the prefix cache, per tier.", labels=["tier"]
        )
        reused = CounterMetricFamily(
            f"{PREFIX}_prefix_tokens_reused", "Prompt tokens reused from the prefix cache, per tier.", labels=["tier"]
        )
        for tier, stats in state["prefix"].items():
            hits.add_metric([tier], stats["hits"])
            reused.add_metric([tier], stats["tokens_reused"])
        yield hits
        yield reused


class ServerMetrics:
    """The metrics of one app: the engine's state, time to first token, inter-token latency, and
    requests answered per endpoint and outcome."""

    def __init__(self, engine_thread):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStateCollector(engine_thread))
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP generation requests answered, by endpoint and outcome (finish reason or HTTP status).",
            ["endpoint", "outcome"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
