"""A pool's replicas, discovered at run time, and the load each one publishes.

A pool is several servers that serve the same engine models (a StatefulSet's pods, or tritonservers on
loopback ports). The orchestrator learns who they are from a source, and how busy each one is from its
Prometheus endpoint, the same families the tensorrtllm backend reports (custom_metrics_reporter.cc):
    nv_trt_llm_request_metrics{model, request_type="active"}         requests in the engine
    nv_trt_llm_kv_cache_block_metrics{model, kv_cache_block_type="free"}   free KV blocks
Sources, as an `engine_urls` value:
    registry:<directory>            one JSON file per replica, {"url": "http://host:port", "metrics": "http://..."},
                                    written by `disagg-serve --announce` once ready and removed before it stops
    dns:<host>:<http port>:<metrics port>   every address the name resolves to, reached over HTTP (a headless
                                    Service lists only its ready pods)
A replica joins once its metrics answer, and leaves when its source stops listing it or its metrics have
not answered for SILENT_S; requests already on a replica that left finish there (the orchestrator keeps
their streams and connections until they end).
"""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from disagg.atomic_file import replace_file
from disagg.serve import metrics

REFRESH_S = 0.25  # membership and load, read again this often
SCRAPE_TIMEOUT_S = 1.0
# A listed replica whose metrics have not answered for this long has left; a slower answer or two (a busy
# machine) does not make it leave.
SILENT_S = 3.0
REQUESTS = "nv_trt_llm_request_metrics"
KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"


@dataclass(frozen=True)
class Replica:
    url: str  # where the orchestrator reaches its engine models (disagg.triton.transport)
    metrics: str  # URL of its Prometheus endpoint


@dataclass(frozen=True)
class Load:
    active: int  # requests in its engine's batch (TensorRT-LLM's active requests; the queued are not counted)
    free_blocks: int


class Source(ABC):
    """Who the replicas of a pool are right now."""

    @abstractmethod
    def replicas(self) -> list[Replica]: ...


class RegistrySource(Source):
    def __init__(self, directory: str):
        self.directory = Path(directory)

    def replicas(self) -> list[Replica]:
        found = []
        try:
            paths = sorted(self.directory.glob("*.json"))
        except OSError:
            return []
        for path in paths:
            try:
                entry = json.loads(path.read_text())
                found.append(Replica(entry["url"], entry["metrics"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written or removed right now
        return found


class DnsSource(Source):
    def __init__(self, host: str, http_port: int, metrics_port: int):
        self.host, self.http_port, self.metrics_port = host, http_port, metrics_port

    def replicas(self) -> list[Replica]:
        try:
            infos = socket.getaddrinfo(self.host, self.http_port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return []  # no ready replica: the name has no address
        # A dual-stack pod has an IPv4 and an IPv6 address: one replica, listed once (by its IPv4 one).
        v4 = {info[4][0] for info in infos if info[0] == socket.AF_INET}
        addresses = sorted(v4 or {info[4][0] for info in infos})
        return [Replica(f"http://{_host(a)}:{self.http_port}", f"http://{_host(a)}:{self.metrics_port}/metrics") for a in addresses]


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def parse_source(value: str) -> Source | None:
    """The source an `engine_urls` value names (`registry:/absolute/dir`, `dns:host:port:port`); None for a
    plain host:port, one fixed server (a host may be called `registry` or `dns`)."""
    kind, _, rest = value.partition(":")
    if kind == "registry" and rest.startswith("/"):
        return RegistrySource(rest)
    parts = rest.rsplit(":", 2)
    if kind == "dns" and len(parts) == 3 and parts[0] and parts[1].isdigit() and parts[2].isdigit():
        return DnsSource(parts[0], int(parts[1]), int(parts[2]))
    return None


def parse_loads(text: str) -> dict[str, Load]:
    """{model: Load} from a Prometheus exposition: the models' series summed over their other labels."""
    active: dict[str, float] = {}
    free: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            if sample.name == REQUESTS and sample.labels.get("request_type") == "active":
                active[model] = active.get(model, 0) + sample.value
            elif sample.name == KV_BLOCKS and sample.labels.get("kv_cache_block_type") == "free":
                free[model] = free.get(model, 0) + sample.value
    return {m: Load(int(active.get(m, 0)), int(free.get(m, 0))) for m in active.keys() | free.keys()}


def wait_quiet(held, timeout_s: float, poll_s: float, readings: int = 3) -> int:
    """How a replica drains before it stops: reads `held()` (the requests it still holds) every `poll_s`
    until `readings` readings in a row are 0 (one may fall between a request's end and the next's start)
    or `timeout_s` has passed; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while True:
        count = held()
        quiet = 0 if count else quiet + 1
        if quiet >= readings or time.monotonic() > deadline:
            return count
        time.sleep(poll_s)


def scrape(metrics_url: str) -> dict[str, Load]:
    """{model: Load} as the Prometheus endpoint at `metrics_url` shows them now."""
    return parse_loads(metrics.scrape(metrics_url, SCRAPE_TIMEOUT_S))


class ReplicaPool:
    """The live replicas of one source and their load, refreshed every REFRESH_S by a thread of its own."""

    def __init__(self, source: Source, refresh_s: float = REFRESH_S, on_leave=lambda url: None):
        """`on_leave(url)` is called (from the pool's thread) for each replica that leaves: a server that
        stops waits for its clients' open streams to end, so the client must let go."""
        self.source, self.refresh_s, self.on_leave = source, refresh_s, on_leave
        self._loads: dict[str, tuple[dict[str, Load], float]] = {}  # url -> ({model: Load}, when read)
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()  # one reading at a time: each replica that leaves is reported once
        self._closed = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="replicas", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Reads the source and every listed replica's metrics now (the pool's thread does it every
        `refresh_s`; a caller that found no replica may not want to wait for that)."""
        with self._refreshing:
            loads = {}
            for replica in self.source.replicas():
                now = time.monotonic()
                try:
                    loads[replica.url] = (scrape(replica.metrics), now)
                except Exception:  # noqa: BLE001 - not serving yet, any more (a cut-off answer), or just slow
                    last = self._loads.get(replica.url)
                    if last is not None and now - last[1] < SILENT_S:
                        loads[replica.url] = last
            with self._lock:
                left = self._loads.keys() - loads.keys()
                self._loads = loads
        for url in sorted(left):
            try:
                self.on_leave(url)
            except Exception:  # noqa: BLE001 - the pool must go on following its replicas whatever the listener does
                pass

    def urls(self) -> list[str]:
        with self._lock:
            return list(self._loads)

    def load(self, url: str, model: str) -> Load | None:
        """What the replica at `url` last published for `model`; None when it is not a live member."""
        with self._lock:
            return self._loads.get(url, ({}, 0.0))[0].get(model)

    def _run(self) -> None:
        while not self._closed.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a source that failed once (its directory, the resolver) is asked again
                pass

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=SCRAPE_TIMEOUT_S * 2)


def announce(directory: str | Path, replica: Replica) -> Path:
    """Lists `replica` in a registry directory (atomically); returns the entry to remove at its stop."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (re.sub(r"[^A-Za-z0-9.]+", "_", replica.url) + ".json")
    replace_file(path, json.dumps({"url": replica.url, "metrics": replica.metrics}).encode())
    return path
