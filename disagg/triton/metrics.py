"""Per-role Prometheus metrics on Triton's metrics port, through `pb_utils.MetricFamily`.

Every series carries `role` and `instance` labels, so a user sees which side is the bottleneck:
    disagg_kv_blocks_in_use / disagg_kv_blocks_total      gauges, per engine instance
    disagg_requests_in_flight / disagg_queue_depth        gauges (queue depth = waiting for KV blocks or a batch slot)
    disagg_kv_handoff_bytes_total / _seconds_total / _count_total / _reclaimed_total   counters
    disagg_ttft_seconds                                   histogram, as the orchestrator sees it
    disagg_first_hop_seconds                              histogram: a request's arrival -> its first engine request sent
    disagg_engine_restarts                                gauge: reloads after an instance died (watchdog), restarts of its server
The families are kept on the object: a Metric dies with its MetricFamily. A model releases them in its
finalize (`release`): a Metric still held when the stub shuts down is destroyed after the backend's shared
memory is gone, and Triton 2.51's stub segfaults on its way out (in `Metric::SaveToSharedMemory`; dmesg:
`triton_python_backend_stub ... segfault at 60`) at every stop. Updates hold STUB_LOCK:
concurrent calls into the stub from many request threads crash Triton 2.51's python backend (a
segfault in libtriton_python.so, seen with 8+ concurrent orchestrated streams). Each update is an IPC
round trip to the server; the orchestrator's go through an `Updater`, so none is on a request's path.
"""
from __future__ import annotations

import queue
import threading
import time

import triton_python_backend_utils as pb_utils

# Serialises this process's calls into the backend stub (metrics, response senders, cancellation checks).
STUB_LOCK = threading.RLock()


class Updater:
    """Applies metric updates from a thread of its own, `period_s` after the first of a batch: a request
    thread only queues them, and a gauge set many times within a batch is sent once (its last value)."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="metrics-updater", daemon=True)
        self._thread.start()

    def put(self, metric, op: str, value: float) -> None:
        self._queue.put((metric, op, value))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            time.sleep(self.period_s)  # off the path of the request that queued it, and a batch gathers
            batch = [item]
            while not self._queue.empty():
                batch.append(self._queue.get())
            self._apply([update for update in batch if update is not None])
            if None in batch:  # closed
                return

    @staticmethod
    def _apply(batch: list) -> None:
        gauges = {}
        with STUB_LOCK:
            for metric, op, value in batch:
                if op == "set":
                    gauges[id(metric)] = (metric, value)
                else:
                    getattr(metric, op)(value)
            for metric, value in gauges.values():
                metric.set(value)


class _Metric:
    """A pb_utils Metric whose updates hold the process-wide lock: applied at once, or queued to an `Updater`."""

    def __init__(self, metric, updater: Updater | None = None):
        self._metric, self._updater = metric, updater

    def _update(self, op: str, value: float) -> None:
        metric = self._metric
        if metric is None:  # released: the model is finalizing
            return
        if self._updater is not None:
            self._updater.put(metric, op, value)
        else:
            with STUB_LOCK:
                getattr(metric, op)(value)

    def release(self) -> None:
        self._metric = None

    def set(self, value: float) -> None:
        self._update("set", value)

    def increment(self, value: float) -> None:
        self._update("increment", value)

    def observe(self, value: float) -> None:
        self._update("observe", value)


TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
TPOT_BUCKETS = [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
# Validating, tokenizing and routing a short prompt take a few tenths of a millisecond; a long prompt's tokenizing,
# or waiting for a worker with `max_in_flight` requests in flight, up to seconds.
FIRST_HOP_BUCKETS = [0.0002, 0.0003, 0.0004, 0.0005, 0.0006, 0.0008, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0]


class Metrics:
    def __init__(self, role: str, instance: str, updater: Updater | None = None):
        self.labels = {"role": role, "instance": instance}
        self.updater = updater
        self._families: dict[str, object] = {}
        self._metrics: dict[str, object] = {}

    def _get(self, name: str, description: str, kind, labels: dict[str, str] | None = None, **kwargs):
        """The series of `name` with `labels` beside role and instance (one family per name)."""
        key = (name, tuple(sorted((labels or {}).items())))
        if key not in self._metrics:
            if name not in self._families:
                self._families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._metrics[key] = _Metric(self._families[name].Metric(labels={**self.labels, **(labels or {})}, **kwargs), self.updater)
        return self._metrics[key]

    def gauge(self, name: str, description: str, labels: dict[str, str] | None = None):
        return self._get(name, description, pb_utils.MetricFamily.GAUGE, labels)

    def counter(self, name: str, description: str, labels: dict[str, str] | None = None):
        return self._get(name, description, pb_utils.MetricFamily.COUNTER, labels)

    def histogram(self, name: str, description: str, buckets: list[float], labels: dict[str, str] | None = None):
        return self._get(name, description, pb_utils.MetricFamily.HISTOGRAM, labels, buckets=buckets)

    def release(self) -> None:
        """Drops every series, then every family (the order the Python backend asks for), in finalize."""
        for metric in self._metrics.values():
            metric.release()
        self._metrics.clear()
        self._families.clear()


class BackendMetrics:
    """The tensorrtllm backend's own gauges, under its names and labels (inflight_batcher_llm/src/
    custom_metrics_reporter/custom_metrics_reporter.cc: families labelled `model` and `version`, one
    series per request_type / kv_cache_block_type), so what reads them (pool replica routing,
    dashboards) reads either backend alike. The values are the model's, all its instances together, and
    only the model's first instance publishes them: Triton 2.51's core counts a series' users per family
    object (core src/metric_family.cc, `MetricFamily::Remove`), while Prometheus hands every stub that asks
    for the same name and labels the same series; so as a model of several instances unloaded, the first
    stub's release freed the series and the next freed it again, and tritonserver crashed at stop
    (`Signal (11)`, `malloc_consolidate(): unaligned fastbin chunk detected`)."""

    REQUEST_TYPES = ("active", "max", "scheduled", "context")
    BLOCK_TYPES = ("max", "free", "used", "tokens_per")

    def __init__(self, model: str, version: str = "1"):
        labels = {"model": model, "version": version}
        requests = pb_utils.MetricFamily(name="nv_trt_llm_request_metrics", description="TRT LLM request metrics",
                                         kind=pb_utils.MetricFamily.GAUGE)
        blocks = pb_utils.MetricFamily(name="nv_trt_llm_kv_cache_block_metrics", description="TRT LLM KV cache block metrics",
                                       kind=pb_utils.MetricFamily.GAUGE)
        self._families = (requests, blocks)  # a Metric dies with its family
        self.requests = {t: _Metric(requests.Metric(labels={**labels, "request_type": t})) for t in self.REQUEST_TYPES}
        self.blocks = {t: _Metric(blocks.Metric(labels={**labels, "kv_cache_block_type": t})) for t in self.BLOCK_TYPES}

    def release(self) -> None:
        """As Metrics.release."""
        for metric in (*self.requests.values(), *self.blocks.values()):
            metric.release()
        self._families = ()

    def update(self, load, tokens_per_block: int) -> None:
        """From a load_board.Load summed over the model's live instances."""
        for kind, value in (("active", load.active), ("max", load.max_batch_size), ("scheduled", load.scheduled),
                            ("context", load.in_context)):
            self.requests[kind].set(value)
        for kind, value in (("max", load.blocks_total), ("free", load.free_blocks), ("used", load.blocks_total - load.free_blocks),
                            ("tokens_per", tokens_per_block)):
            self.blocks[kind].set(value)


class EngineMetrics(Metrics):
    """Gauges the engine model refreshes every 0.1 s, counters for the KV handoff."""

    def __init__(self, role: str, instance: str):
        super().__init__(role, instance)
        self.blocks_in_use = self.gauge("disagg_kv_blocks_in_use", "KV cache blocks held (running, waiting for handoff)")
        self.blocks_total = self.gauge("disagg_kv_blocks_total", "KV cache blocks in the pool")
        self.in_flight = self.gauge("disagg_requests_in_flight", "Requests admitted or waiting in the engine")
        self.queue_depth = self.gauge("disagg_queue_depth", "Requests waiting for a batch slot or KV blocks")
        self.handoff_held = self.gauge("disagg_kv_handoff_held", "Context-phase KV waiting to be pulled by decode")
        self.handoff_bytes = self.counter("disagg_kv_handoff_bytes_total", "KV bytes pulled from prefill")
        self.handoff_seconds = self.counter("disagg_kv_handoff_seconds_total", "Seconds spent pulling KV from prefill")
        self.handoff_count = self.counter("disagg_kv_handoff_count_total", "KV handoffs completed")
        self.reclaimed = self.counter("disagg_kv_handoff_reclaimed_total", "Handoffs freed by lease expiry")
        self.restarts = self.gauge("disagg_engine_restarts", "Reloads of this engine model after an instance of it died, and restarts of its tritonserver")
        self.blocks_cached = self.gauge("disagg_kv_blocks_cached", "KV blocks kept for prefix reuse (enable_kv_cache_reuse)")
        self.reused_blocks = self.gauge("disagg_kv_reused_blocks", "Prompt blocks found cached, since the instance started")
        self.prompt_blocks = self.gauge("disagg_kv_prompt_blocks", "Prompt blocks looked up for reuse, since the instance started")
        self.hit_rate = self.gauge("disagg_kv_prefix_hit_rate", "Prompt blocks found cached / looked up, since the instance started")
        self.reused_tokens = self.gauge("disagg_kv_reused_tokens", "Prompt tokens whose KV was reused instead of computed, since the instance started")
        self.store_hits = self.gauge("disagg_kv_store_hits", "Prompt blocks imported from the node's prefix store, since the instance started")
        self.store_bytes = self.gauge("disagg_kv_store_bytes", "Bytes in the node's prefix store (kv_store_mb)")
        self.store_evictions = self.gauge("disagg_kv_store_evictions", "Blocks this instance removed from the store to make room")

    def update(self, stats, held_handoffs: int = 0) -> None:
        self.blocks_in_use.set(stats.blocks_used)
        self.blocks_total.set(stats.blocks_total)
        self.in_flight.set(stats.in_flight)
        self.queue_depth.set(stats.waiting)
        self.handoff_held.set(held_handoffs)
        self.blocks_cached.set(stats.blocks_cached)
        self.reused_blocks.set(stats.reused_blocks)
        self.prompt_blocks.set(stats.prompt_blocks)
        self.hit_rate.set(stats.reused_blocks / stats.prompt_blocks if stats.prompt_blocks else 0.0)
        self.reused_tokens.set(stats.reused_blocks * stats.tokens_per_block)
        self.store_hits.set(stats.store_hits)
