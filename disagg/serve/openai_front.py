"""Starts and stops the OpenAI-compatible API (`python -m disagg.openai`) next to a tritonserver.

Its own process, so its event loop never shares a GIL with anything else of ours; it dies with the
process (thread) that started it, like the server.
"""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from disagg.serve.server import ServerError, die_with_parent, free_ports


class OpenAIFront:
    """`python -m disagg.openai` for `model_repository`, reaching the server at `grpc_url`, listening on
    `host:port` (port None: a free one). `metrics_urls`: {server name: its metrics URL}, merged on the
    API's `/metrics`. `log_path`: file for its output (None: inherit ours)."""

    def __init__(self, model_repository: str | Path, grpc_url: str, *, host: str = "127.0.0.1",
                 port: int | None = None, metrics_urls: dict[str, str] | None = None, log_path: str | Path | None = None):
        self.model_repository = Path(model_repository)
        self.grpc_url = grpc_url
        self.metrics_urls = dict(metrics_urls or {})
        self.host = host
        self.port = free_ports(1)[0] if port is None else port
        self.log_path = Path(log_path) if log_path is not None else None
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host == "0.0.0.0" else self.host
        return f"http://{host}:{self.port}/v1"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "disagg.openai", f"--model-repository={self.model_repository}",
                f"--triton-grpc-url={self.grpc_url}", f"--host={self.host}", f"--port={self.port}",
                *(f"--metrics-url={name}={url}" for name, url in self.metrics_urls.items())]

    def start(self) -> OpenAIFront:
        out = open(self.log_path, "ab") if self.log_path is not None else None
        try:
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT if out else None,
                                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        finally:
            if out is not None:
                out.close()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Polls GET /v1/models until it answers; ServerError if the process exits first or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path else "(see the console above)"
                raise ServerError(f"the OpenAI API exited with code {code} before it was ready:\n{log}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2.0):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"the OpenAI API did not answer on {self.base_url} within {timeout:.0f} s")
            time.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> OpenAIFront:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
