"""Samples Triton's metrics endpoint during a run, so a report shows which side is the bottleneck.

Every `interval_s` it scrapes `http://127.0.0.1:<metrics_port>/metrics` (disagg.serve.metrics: parsed with
prometheus_client, summed over each role's instances) and keeps the per-role series of
disagg/triton/metrics.py: KV blocks in use and total, queue depth, requests in flight, and the KV handoff
counters. The summary has one line per role, e.g.
    decode: KV blocks in use max 120/640, queue depth max 3, in flight max 9; KV handoff 57 transfers, 1.9 MB, mean 0.41 ms
Stamps are time.perf_counter(), the clock of the load-test samples.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from disagg.serve.metrics import by_role, scrape

GAUGES = ("disagg_kv_blocks_in_use", "disagg_kv_blocks_total", "disagg_queue_depth", "disagg_requests_in_flight",
          "disagg_orchestrator_in_flight")
COUNTERS = ("disagg_kv_handoff_bytes_total", "disagg_kv_handoff_seconds_total", "disagg_kv_handoff_count_total")


@dataclass(frozen=True)
class MetricsSeries:
    """Scrapes of one run: `t` (perf_counter) and, per metric and role, the value summed over the role's
    instances at each scrape (None where the series was absent)."""

    t: tuple[float, ...]
    series: dict[str, dict[str, list[float | None]]]

    def role_values(self, metric: str) -> dict[str, list[float]]:
        return {role: [v or 0.0 for v in values] for role, values in self.series.get(metric, {}).items()}

    def summary(self) -> dict[str, dict[str, float]]:
        """Per role: the gauges' maxima over the run and the counters' increase during it."""
        out: dict[str, dict[str, float]] = {}
        for metric in GAUGES:
            for role, values in self.role_values(metric).items():
                out.setdefault(role, {})[f"max_{metric}"] = max(values, default=0.0)
        for metric in COUNTERS:
            for role, values in self.role_values(metric).items():
                out.setdefault(role, {})[f"delta_{metric}"] = values[-1] - values[0] if values else 0.0
        return out

    def summary_lines(self) -> list[str]:
        lines = []
        for role, s in sorted(self.summary().items()):
            parts = []
            if "max_disagg_kv_blocks_in_use" in s:
                parts.append(f"KV blocks in use max {s['max_disagg_kv_blocks_in_use']:.0f}/{s.get('max_disagg_kv_blocks_total', 0):.0f}")
            if "max_disagg_queue_depth" in s:
                parts.append(f"queue depth max {s['max_disagg_queue_depth']:.0f}")
            in_flight = s.get("max_disagg_requests_in_flight", s.get("max_disagg_orchestrator_in_flight"))
            if in_flight is not None:
                parts.append(f"in flight max {in_flight:.0f}")
            line = f"{role}: " + ", ".join(parts)
            count = s.get("delta_disagg_kv_handoff_count_total", 0.0)
            if count:
                mb = s.get("delta_disagg_kv_handoff_bytes_total", 0.0) / 1e6
                ms = s.get("delta_disagg_kv_handoff_seconds_total", 0.0) / count * 1e3
                line += f"; KV handoff {count:.0f} transfers, {mb:.1f} MB, mean {ms:.2f} ms"
            lines.append(line)
        return lines

    def to_dict(self) -> dict:
        return {"t": list(self.t), "series": self.series, "summary": self.summary(), "summary_lines": self.summary_lines()}

    @classmethod
    def from_dict(cls, raw: dict) -> MetricsSeries:
        return cls(tuple(raw["t"]), raw["series"])


class MetricsSampler:
    """Scrapes `url` on a daemon thread from start() to stop(); a failed scrape is skipped and counted."""

    def __init__(self, url: str, interval_s: float = 0.5):
        self.url = url
        self.interval_s = interval_s
        self.failures = 0
        self._scrapes: list[tuple[float, dict[str, dict[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                self._scrapes.append((started, by_role(scrape(self.url, timeout_s=2.0))))
            except OSError:
                self.failures += 1
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def start(self) -> MetricsSampler:
        self._thread.start()
        return self

    def stop(self) -> MetricsSeries:
        self._stop.set()
        self._thread.join(5.0)
        series: dict[str, dict[str, list[float | None]]] = {}
        for metric in GAUGES + COUNTERS:
            roles = sorted({role for _, scrape_ in self._scrapes for role in scrape_.get(metric, {})})
            for role in roles:
                series.setdefault(metric, {})[role] = [s.get(metric, {}).get(role) for _, s in self._scrapes]
        return MetricsSeries(tuple(t for t, _ in self._scrapes), series)
