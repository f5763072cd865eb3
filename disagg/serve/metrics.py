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
