"""A `disagg-serve` process on free loopback ports, its output kept: the replicas and fronts of the pool
tests and of `python -m disagg.bench sla`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from disagg.serve import free_ports
from disagg.serve.metrics import scrape
from disagg.triton.replicas import parse_loads


class Served:
    """One `disagg-serve` process, its output kept; `ready()` waits for its "ready" line."""

    def __init__(self, name: str, repository: Path, env: dict[str, str], *flags: str):
        self.name = name
        self.http, self.grpc, self.metrics = free_ports(3)
        launcher = Path(sys.executable).parent / "disagg-serve"
        self.proc = subprocess.Popen(
            [str(launcher), "--model-repository", str(repository), "--http-port", str(self.http), "--grpc-port", str(self.grpc),
             "--metrics-port", str(self.metrics), "--no-openai", "--exit-timeout-secs=20", *flags],
            env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.strip() == "disagg-serve: ready":
                self._ready.set()

    def ready(self, timeout_s: float = 120) -> Served:
        assert self._ready.wait(timeout_s), f"{self.name} not ready:\n" + "".join(self.lines[-30:])
        return self

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def load(self, model: str):
        return parse_loads(self._scrape()).get(model)

    def inferences(self, model: str) -> int:
        """Requests the model has completed here (Triton's nv_inference_count, as one scrape shows it)."""
        text = self._scrape()
        prefix = f'nv_inference_count{{model="{model}",version="1"}} '
        return next((int(float(line[len(prefix):])) for line in text.splitlines() if line.startswith(prefix)), 0)

    def _scrape(self) -> str:
        """Triton's metrics page; a server not answering fails with what its process last printed."""
        try:
            return scrape(f"http://127.0.0.1:{self.metrics}/metrics", 2.0)
        except OSError as exc:
            raise RuntimeError(f"{self.name}: metrics on port {self.metrics}: {exc}\n" + "".join(self.lines[-60:])) from exc

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
