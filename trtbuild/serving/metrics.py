"""The server's Prometheus metrics: what the scheduler observes, in prometheus_client's collectors.

Each server gets its own registry (no process-global state, so tests can start several). Names follow
Prometheus' conventions (base units, `_total` counters); `trtbuild_decode_step_seconds` with the
`trtbuild_decode_context_tokens_total` and `trtbuild_engine_*_bytes` gauges is what a benchmark needs to
put a decode step beside its floor (weights plus the filled KV cache read once a step).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 1 ms (a decode step of a small model on a GPU) to a minute (a long queue).
_LATENCY = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
            1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FRACTION = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The collectors, and the scheduler's Observer methods that feed them."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("trtbuild_requests", "Requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("trtbuild_requests_rejected", "Requests refused before they were queued, by reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("trtbuild_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("trtbuild_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("trtbuild_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("trtbuild_time_per_output_token_seconds", "Between one token of a request and the next",
                              buckets=_LATENCY, registry=r)
        self.step_s = Histogram("trtbuild_decode_step_seconds", "One decode step, by batch bucket", ["bucket"],
                                buckets=_LATENCY, registry=r)
        self.step_rows = Counter("trtbuild_decode_rows", "Running rows summed over decode steps, by batch bucket",
                                 ["bucket"], registry=r)
        self.step_context = Counter("trtbuild_decode_context_tokens", "Cached tokens attended to, summed over "
                                    "decode steps and rows, by batch bucket", ["bucket"], registry=r)
        self.occupancy = Histogram("trtbuild_batch_occupancy", "Running rows / the bucket's rows, one per decode step",
                                   buckets=_FRACTION, registry=r)
        self.queue = Gauge("trtbuild_queue_length", "Requests waiting for a row", registry=r)
        self.running = Gauge("trtbuild_running_requests", "Requests holding a row", registry=r)
        self.ready = Gauge("trtbuild_ready", "1 once the engine is loaded and warmed", registry=r)
        self.weight_bytes = Gauge("trtbuild_engine_weight_bytes", "Weight bytes a decode step reads", registry=r)
        self.kv_bytes_per_token = Gauge("trtbuild_engine_kv_bytes_per_token", "KV-cache bytes per cached token "
                                        "(all layers, keys and values)", registry=r)
        self.rows = Gauge("trtbuild_engine_rows", "Cache rows (max_batch_size)", registry=r)
        self.kv_blocks = Gauge("trtbuild_kv_blocks", "KV-cache blocks of the paged pool: used (held by a "
                               "request) and free (never used, or cached with no request holding them)", ["state"],
                               registry=r)
        self.prefix_blocks = Counter("trtbuild_prefix_cache_blocks", "Full prompt blocks looked up in the prefix "
                                     "cache: hit (taken, not prefilled again) or miss", ["result"], registry=r)
        self.preemptions = Counter("trtbuild_preemptions", "Requests preempted for want of KV blocks (recomputed "
                                   "later)", registry=r)
        self.device_s = Counter("trtbuild_device_busy_seconds", "Device time of the launched paged steps, from the "
                                "stream reaching each to its last kernel's end: its rate is the fraction of the "
                                "time the device computes (the rest it waits for the host)", registry=r)
        self._prefix_seen = (0, 0)
        self.model = model

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def describe_engine(self, engine: Any, elem: int) -> None:
        """The engine's sizes, where it says them (the torch backend's TorchEngine does); `elem` is the
        precision's bytes per element."""
        self.rows.set(engine.max_batch_size)
        if (w := getattr(engine, "weight_bytes", None)) is not None:
            self.weight_bytes.set(w)
        cfg = getattr(engine, "cfg", None)
        if cfg is not None:
            self.kv_bytes_per_token.set(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem)

    # -- scheduler.Observer ---------------------------------------------------------------------------------
    def queued(self, waiting: int, running: int) -> None:
        self.queue.set(waiting)
        self.running.set(running)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def token_interval(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None:
        b = str(bucket)
        self.step_s.labels(b).observe(seconds)
        self.step_rows.labels(b).inc(rows)
        self.step_context.labels(b).inc(context_tokens)
        self.occupancy.observe(rows / bucket)

    def finished(self, reason: str, generated: int) -> None:
        self.requests.labels(reason).inc()
        self.generation_tokens.inc(generated)

    def blocks(self, used: int, free: int, hits: int, misses: int) -> None:
        self.kv_blocks.labels("used").set(used)
        self.kv_blocks.labels("free").set(free)
        seen_hits, seen_misses = self._prefix_seen  # the pool counts from its start; counters take increments
        self.prefix_blocks.labels("hit").inc(hits - seen_hits)
        self.prefix_blocks.labels("miss").inc(misses - seen_misses)
        self._prefix_seen = (hits, misses)

    def preempted(self) -> None:
        self.preemptions.inc()

    def device_busy(self, seconds: float) -> None:
        self.device_s.inc(seconds)
