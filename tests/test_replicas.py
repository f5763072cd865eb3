"""Replica discovery below the model boundary: sources, the load a replica publishes, pool membership."""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from disagg.triton import replicas
from disagg.triton.replicas import DnsSource, Load, RegistrySource, Replica, ReplicaPool, announce, parse_loads, parse_source

# What the tensorrtllm backend's custom_metrics_reporter.cc exposes, trimmed: gauges labelled model and version.
EXPOSITION = """\
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{model="decode",request_type="context",version="1"} 0
nv_trt_llm_request_metrics{model="decode",request_type="scheduled",version="1"} 3
nv_trt_llm_request_metrics{model="decode",request_type="max",version="1"} 8
nv_trt_llm_request_metrics{model="decode",request_type="active",version="1"} 5
nv_trt_llm_request_metrics{model="decode_1",request_type="active",version="1"} 1
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="decode",version="1"} 16
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="decode",version="1"} 120
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="decode",version="1"} 8
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="decode_1",version="1"} 64
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="decode",version="1"} 42
"""


def test_a_replicas_load_is_read_from_the_tensorrtllm_backends_metric_families():
    assert parse_loads(EXPOSITION) == {"decode": Load(active=5, free_blocks=120), "decode_1": Load(active=1, free_blocks=64)}


def test_sources_are_named_in_engine_urls():
    registry = parse_source("registry:/run/pools/decode")
    assert isinstance(registry, RegistrySource) and str(registry.directory) == "/run/pools/decode"
    dns = parse_source("dns:decode-h100:8000:8002")
    assert isinstance(dns, DnsSource) and (dns.host, dns.http_port, dns.metrics_port) == ("decode-h100", 8000, 8002)
    assert parse_source("decode-pool:8001") is None


def test_dns_lists_every_address_of_the_name():
    assert DnsSource("localhost", 8000, 8002).replicas()[0] in (
        Replica("http://127.0.0.1:8000", "http://127.0.0.1:8002/metrics"), Replica("http://[::1]:8000", "http://[::1]:8002/metrics"))
    assert DnsSource("no-such-pool.invalid", 8000, 8002).replicas() == []


def test_the_registry_lists_announced_replicas_and_skips_what_it_cannot_read(tmp_path):
    source = RegistrySource(str(tmp_path / "decode"))
    assert source.replicas() == []
    one = announce(tmp_path / "decode", Replica("http://127.0.0.1:9100", "http://127.0.0.1:9102/metrics"))
    announce(tmp_path / "decode", Replica("http://127.0.0.1:9200", "http://127.0.0.1:9202/metrics"))
    (tmp_path / "decode" / "half-written.json").write_text('{"url": ')
    assert [r.url for r in source.replicas()] == ["http://127.0.0.1:9100", "http://127.0.0.1:9200"]
    one.unlink()
    assert [r.url for r in source.replicas()] == ["http://127.0.0.1:9200"]
    assert sorted(p.name for p in (tmp_path / "decode").iterdir()) == ["half-written.json", "http_127.0.0.1_9200.json"]


@pytest.fixture
def metrics_server():
    """A Prometheus endpoint on a loopback port serving what `body[0]` holds."""
    body = [EXPOSITION]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics", body
    server.shutdown()
    server.server_close()


def test_a_pool_admits_replicas_whose_metrics_answer_and_follows_their_load(tmp_path, metrics_server):
    url, body = metrics_server
    registry = tmp_path / "decode"
    announce(registry, Replica("127.0.0.1:9101", url))
    announce(registry, Replica("127.0.0.1:9201", "http://127.0.0.1:9/metrics"))  # nothing listens there
    pool = ReplicaPool(RegistrySource(str(registry)), refresh_s=0.05)
    try:
        assert pool.urls() == ["127.0.0.1:9101"]
        assert pool.load("127.0.0.1:9101", "decode") == Load(5, 120)
        assert pool.load("127.0.0.1:9201", "decode") is None
        body[0] = EXPOSITION.replace('request_type="active",version="1"} 5', 'request_type="active",version="1"} 7')
        _until(lambda: pool.load("127.0.0.1:9101", "decode") == Load(7, 120))
        (registry / "127.0.0.1_9101.json").unlink()
        _until(lambda: pool.urls() == [])
    finally:
        pool.close()


def _until(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_registry_entry_is_json_naming_both_endpoints(tmp_path):
    path = announce(tmp_path, Replica("http://[::1]:8000", "http://[::1]:8002/metrics"))
    assert path.name == "http_1_8000.json"
    assert json.loads(path.read_text()) == {"url": "http://[::1]:8000", "metrics": "http://[::1]:8002/metrics"}
    assert replicas.RegistrySource(str(tmp_path)).replicas() == [Replica("http://[::1]:8000", "http://[::1]:8002/metrics")]


def test_a_replica_whose_metrics_go_quiet_stays_a_moment_then_leaves(tmp_path, metrics_server, monkeypatch):
    monkeypatch.setattr(replicas, "SILENT_S", 0.5)
    url, body = metrics_server
    announce(tmp_path, Replica("127.0.0.1:9101", url))
    left: list[str] = []
    pool = ReplicaPool(RegistrySource(str(tmp_path)), refresh_s=0.05, on_leave=left.append)
    try:
        (tmp_path / "127.0.0.1_9101.json").write_text(json.dumps({"url": "127.0.0.1:9101", "metrics": "http://127.0.0.1:9/metrics"}))
        time.sleep(0.2)  # its metrics stopped answering: one slow answer is not leaving
        assert pool.urls() == ["127.0.0.1:9101"] and pool.load("127.0.0.1:9101", "decode") == Load(5, 120) and left == []
        _until(lambda: pool.urls() == [])
        assert left == ["127.0.0.1:9101"]
    finally:
        pool.close()


def test_an_engine_pods_prestop_waits_until_its_engines_hold_no_request(metrics_server, monkeypatch):
    from disagg.k8s import prestop

    monkeypatch.setattr(prestop, "POLL_S", 0.02)
    url, body = metrics_server
    idle = EXPOSITION.replace('request_type="active",version="1"} 5', 'request_type="active",version="1"} 0').replace(
        'model="decode_1",request_type="active",version="1"} 1', 'model="decode_1",request_type="active",version="1"} 0')
    threading.Timer(0.4, lambda: body.__setitem__(0, idle)).start()
    started = time.monotonic()
    assert prestop.wait_idle(url, after_s=0.1, timeout_s=5) == 0
    assert 0.4 <= time.monotonic() - started < 2
    body[0] = EXPOSITION
    assert prestop.wait_idle(url, after_s=0, timeout_s=0.3) == 6  # still busy when its time is up: decode 5 + decode_1 1
    assert prestop.wait_idle("http://127.0.0.1:9/metrics", after_s=0, timeout_s=1) == 0  # its server is gone


def test_a_host_named_like_a_source_is_a_host(tmp_path):
    assert parse_source("registry:8001") is None and parse_source("dns:8001") is None and parse_source("registry:") is None
    assert isinstance(parse_source(f"registry:{tmp_path}"), RegistrySource)


def test_the_pool_keeps_following_its_replicas_whatever_a_scrape_or_a_listener_raises(tmp_path, metrics_server, monkeypatch):
    import http.client

    url, _ = metrics_server
    announce(tmp_path, Replica("127.0.0.1:9101", url))
    calls = []

    def leave(url):
        calls.append(url)
        raise RuntimeError("listener broke")

    pool = ReplicaPool(RegistrySource(str(tmp_path)), refresh_s=0.05, on_leave=leave)
    try:
        real = replicas.scrape
        monkeypatch.setattr(replicas, "scrape", lambda r: (_ for _ in ()).throw(http.client.IncompleteRead(b"")))
        time.sleep(0.2)
        assert pool.urls() == ["127.0.0.1:9101"]  # one cut-off answer is not leaving
        monkeypatch.setattr(replicas, "scrape", real)
        (tmp_path / "127.0.0.1_9101.json").unlink()
        _until(lambda: pool.urls() == [])
        announce(tmp_path, Replica("127.0.0.1:9201", url))
        _until(lambda: pool.urls() == ["127.0.0.1:9201"])  # the thread lived through both
        assert calls == ["127.0.0.1:9101"]
    finally:
        pool.close()


def test_a_request_that_finds_no_replica_has_the_pool_read_again_before_it_is_refused(tmp_path, metrics_server):
    """A replica that joined since the pool's last reading (a front that just started) serves the request."""
    from stub_helpers import imported_with_stub

    url, _ = metrics_server
    source = f"registry:{tmp_path}"
    pool = ReplicaPool(RegistrySource(str(tmp_path)), refresh_s=3600)  # its thread will not read it again
    try:
        with imported_with_stub("disagg.triton.routing") as routing:
            router = object.__new__(routing.Router)
            router.pools, router.pools_of, router.engine_urls = {source: pool}, {"decode": [source]}, {"decode": source}
            with pytest.raises(routing.HopError, match=rf"^decode: no replica is serving \(registry:{tmp_path}\): retry shortly$"):
                router.candidates(["decode"])
            announce(tmp_path, Replica("127.0.0.1:9101", url))
            assert router.candidates(["decode"]) == [routing.Engine("decode", "127.0.0.1:9101", source)]
    finally:
        pool.close()
