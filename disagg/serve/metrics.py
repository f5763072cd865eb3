"""Reading Triton's Prometheus endpoint back: the disagg_* series summed per role."""
from __future__ import annotations

import urllib.request
from collections import defaultdict

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
