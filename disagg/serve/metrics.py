"""Reading Triton's Prometheus endpoint back: the disagg_* series summed per role."""
from __future__ import annotations

import math
import operator
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


def scrape(metrics_url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        return response.read().decode()


def by_role(text: str, prefix: str = "disagg_") -> dict[str, dict[str, float]]:
    """{sample name: {role: value summed over instances}} for every sample whose name starts with prefix."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix) and "le" not in sample.labels:
                out[sample.name][sample.labels.get("role", "")] += sample.value
    return {name: dict(roles) for name, roles in out.items()}


@dataclass(frozen=True)
class Histogram:
    """One histogram series: cumulative counts by upper bound (`le`, the last +Inf), its sum and count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def since(self, before: Histogram | None) -> Histogram:
        """What was observed after `before` (an earlier reading of the same series; None: nothing then)."""
        return self if before is None else self._each(before, operator.sub)

    def plus(self, other: Histogram) -> Histogram:
        """Both series' observations (of one family: the same bounds)."""
        return self._each(other, operator.add)

    def _each(self, other: Histogram, op: Callable[[float, float], float]) -> Histogram:
        """`op` of the two series, bucket by bucket, sum and count."""
        return Histogram(tuple((le, op(n, m)) for (le, n), (_, m) in zip(self.buckets, other.buckets)),
                         op(self.sum, other.sum), op(self.count, other.count))

    def quantile(self, q: float) -> float:
        """As Prometheus's histogram_quantile: linear within the bucket that holds the q-th observation
        (nan without observations; the highest finite bound when it falls in +Inf)."""
        if self.count <= 0:
            return math.nan
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
            lower, below = le, cumulative
        return lower


def histograms(text: str, name: str, label: str = "instance") -> dict[str, Histogram]:
    """{value of `label`: its series} of histogram family `name` in a Prometheus exposition."""
    parts: dict[str, dict] = defaultdict(lambda: {"buckets": [], "sum": 0.0, "count": 0.0})
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            series = parts[sample.labels.get(label, "")]
            if sample.name == f"{name}_bucket":
                series["buckets"].append((float(sample.labels["le"]), sample.value))
            elif sample.name == f"{name}_sum":
                series["sum"] = sample.value
            elif sample.name == f"{name}_count":
                series["count"] = sample.value
    return {key: Histogram(tuple(sorted(p["buckets"])), p["sum"], p["count"]) for key, p in parts.items()}


def merge(texts: dict[str, str]) -> str:
    """Several servers' Prometheus expositions as one: each family's HELP and TYPE once, every sample
    labelled `server` with the name of the server it came from (disagg-serve runs engines apart)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = defaultdict(list)
    for server, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    kinds = headers.setdefault(family, [])
                    if not any(h.split(None, 2)[1] == parts[1] for h in kinds):
                        kinds.append(line)
            elif line.strip():
                samples[family].append(_labelled(line, server))
    out = []
    for family in dict.fromkeys([*headers, *samples]):
        out += headers.get(family, []) + samples.get(family, [])
    return "\n".join(out) + "\n"


def _labelled(sample: str, server: str) -> str:
    """`name{a="1"} 2` -> `name{server="s",a="1"} 2`; `name 2` -> `name{server="s"} 2`."""
    end = min(i for i in (sample.find("{"), sample.find(" ")) if i >= 0)
    label = f'server="{server}"'
    if sample[end] == "{":
        rest = sample[end + 1:]
        return f"{sample[:end]}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:end]}{{{label}}}{sample[end:]}"
