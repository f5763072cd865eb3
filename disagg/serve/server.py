"""Starts and stops a real `tritonserver` process.

The binary comes from one of two places:
- a `tritonserver` on PATH (an NGC Triton container): run as it is, with its own backends;
- otherwise the server bundled in the `nvidia-pytriton` wheel, prepared as docs/triton-on-cpu.md says:
  a backend directory whose `python/` holds `libtriton_python.so`, `triton_python_backend_utils.py` and the
  running Python's stub renamed `triton_python_backend_stub`, and `nvidia_pytriton.libs` on LD_LIBRARY_PATH.
Either way the current interpreter's bin directory goes first on PATH, because the Python backend stub runs
the first `python3` it finds there: that is what makes models import this virtualenv (and `disagg`).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

from pathlib import Path

from disagg.repository import RenderError, instance_count, parse_config
from disagg.serve.guard import Orders
from disagg.serve.leftovers import end_orphan_stubs, end_server, sweep, sweep_workdirs
from disagg.serve.leftovers import names as shm_names
from disagg.triton.contract import ENGINE_URL_ENV
from disagg.triton.credential import internal_key
from disagg.triton.load_board import board_key

_PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
_LIBPYTHON = f"libpython{_PY_VERSION}.so.1.0"
_SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/lib", "/usr/lib")
_PR_SET_PDEATHSIG = 1
_GLOG_ERROR = re.compile(r"E\d{4} ")  # Triton's log lines of severity ERROR: E<month><day> <time> ...
# tritonserver's own handler prints this for any fatal signal (SIGSEGV, SIGABRT) and for a stop (SIGINT,
# SIGTERM); a Python stub never does.
_SIGNAL_LINE = re.compile(rb"^Signal \((\d+)\) received\.")
_OUTPUT_LOCK = threading.Lock()
# Not `-m disagg.serve.guard`: this package's __init__ imports the guard first, and runpy warns of that.
GUARD_MAIN = "from disagg.serve.guard import main; main()"
# What each instance of a Python model beyond its first adds to a stop: the backend finalizes a model's
# instances one after another, each after a 1-s sleep (python_backend r24.10, src/stub_launcher.cc
# `UpdateHealth`, from `~ModelInstanceState`); 1.2 s apiece on this machine.
SERIAL_UNLOAD_S = 1.5


def serial_unload_s(model_repository: str | Path) -> int:
    """Seconds a stop needs beyond one instance's unload for the repository's Python model with the most
    instances (models unload side by side, a model's instances one after another)."""
    most = 1
    for path in Path(model_repository).glob("*/config.pbtxt"):
        try:
            config = parse_config(path.parent.name, path.read_text())
        except (OSError, RenderError):
            continue  # a model that cannot load holds nothing up at a stop
        if config.backend == "python":
            most = max(most, instance_count(config))
    return math.ceil(SERIAL_UNLOAD_S * (most - 1))


class ServerError(RuntimeError):
    """tritonserver cannot be started, did not become ready, or something it needs is missing."""


def _ephemeral_range() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_ports(count: int, exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct free TCP ports on loopback, outside the ephemeral range: a port the kernel hands
    out for outgoing connections can be taken by one (the server's own gRPC clients connect while it
    starts) before the server listens on it, and Triton then runs without that endpoint. `exclude`: ports
    promised to servers not yet listening, which look free too."""
    if count == 0:
        return []
    ephemeral, taken = _ephemeral_range(), set(exclude)
    candidates = [p for p in range(10000, 65536) if p not in ephemeral and p not in taken]
    picked: list[int] = []
    for port in random.sample(candidates, len(candidates)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == count:
            return picked
    raise ServerError(f"no {count} free loopback ports outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1}")


@dataclass(frozen=True)
class ServerInstall:
    """How to run one tritonserver: the binary, the backend directory to pass (None: the binary's
    default), and the environment variables to add."""

    binary: Path
    backend_dir: Path | None
    env: dict[str, str]
    description: str


def find_libpython(search_dirs: tuple[str, ...] = _SYSTEM_LIB_DIRS) -> Path | None:
    """Directory holding the libpython the bundled stub should link, or None when the loader finds one
    anyway (ldconfig cache). Raises ServerError naming the Debian package when there is none.

    The running interpreter's own shared library comes first: the stub runs this interpreter's standard
    library, and a libpython of another patch release breaks parts of it (Debian's 3.11.2 under a 3.11.7
    stdlib: `multiprocessing.shared_memory` fails on `RLock._recursion_count`).
    """
    own = sysconfig.get_config_var("LIBDIR")
    if own and (Path(own) / _LIBPYTHON).is_file():
        return Path(own)
    if ctypes.util.find_library(f"python{_PY_VERSION}") == _LIBPYTHON:
        return None
    for d in (*os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep), *search_dirs):
        if d and (Path(d) / _LIBPYTHON).is_file():
            return Path(d)
    raise ServerError(
        f"the Triton Python backend stub for Python {_PY_VERSION} needs {_LIBPYTHON}, which is not installed: "
        f"install the Debian package libpython{_PY_VERSION} (apt-get install libpython{_PY_VERSION})"
    )


def _bundled_install(workdir: Path) -> ServerInstall:
    try:
        import pytriton
    except ImportError:
        raise ServerError(
            "no tritonserver on PATH and the nvidia-pytriton package is not installed (pip install nvidia-pytriton)"
        ) from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    stub = root / "python_backend_stubs" / _PY_VERSION / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {_PY_VERSION} (looked in {stub})")
    libpython_dir = find_libpython()
    lib_dirs = ([str(libpython_dir)] if libpython_dir else []) + [str(libs)]
    backend_dir = workdir / "backends"
    python_dir = backend_dir / "python"
    python_dir.mkdir(parents=True)
    backend_src = root / "backends" / "python"
    (python_dir / "libtriton_python.so").symlink_to(backend_src / "libtriton_python.so")
    (python_dir / "triton_python_backend_utils.py").symlink_to(backend_src / "triton_python_backend_utils.py")
    (python_dir / "triton_python_backend_stub").symlink_to(stub)
    old = os.environ.get("LD_LIBRARY_PATH")
    return ServerInstall(
        binary=root / "bin" / "tritonserver",
        backend_dir=backend_dir,
        env={"LD_LIBRARY_PATH": os.pathsep.join(lib_dirs + ([old] if old else []))},
        description=f"tritonserver bundled with nvidia-pytriton ({root})",
    )


def find_install(workdir: Path) -> ServerInstall:
    """The tritonserver on PATH if there is one, else the bundled one prepared under `workdir`."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerInstall(Path(on_path), None, {}, f"tritonserver on PATH ({on_path})")
    return _bundled_install(workdir)


def die_with_parent() -> None:
    # Runs in the child before exec: the server gets SIGTERM when the process (thread) that started it
    # dies, so a killed test run or launcher never leaves a server holding its ports.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


METRICS_INTERVAL_MS = 250  # Triton's own CPU metrics, collected this often (its default: 2000)


class TritonServer:
    """One tritonserver process serving `model_repository`.

    Ports left as None are picked free on loopback. `address` binds HTTP, gRPC and metrics (None: the
    server's default, all interfaces). `log_path`: file receiving the server's stdout and stderr (None:
    inherit ours). `extra_args` go to tritonserver unchanged (e.g. `--model-control-mode=explicit`).
    `exit_timeout_s`: `--exit-timeout-secs`, short by default because with a decoupled model loaded
    shutdown otherwise waits up to 30 s (None: the server's default), plus `serial_unload_s` for a model of
    several instances. Here a model of four instances unloaded 0.07 s before a 5-s timeout ran out, and one
    of five did not (tritonserver gave up on it and exited with 1); with the allowance both stop cleanly.
    `backend_dir`: a ready backend directory; None prepares one for the bundled server. `env`: variables
    to add to its environment. `sweeps_deployment`: whether its start and stop remove the deployment's
    shared-memory objects (disagg.serve.leftovers); a server that is one of several of a deployment
    leaves that to whoever runs them all, and removes only the Python-backend regions its own run left. `label`: with no
    `log_path`, the server's output is copied to ours line by line, each prefixed `[label] `, and a
    fatal-signal line sets `crashed_at` (a crash can deadlock in tritonserver's signal handler and
    never exit). `auto_complete`: leave Triton's config auto-completion on. It is off by default: the
    rendered configs are complete and our Python models define no `auto_complete_config`, yet with it on
    the Python backend starts and ends one extra stub process per model load (python_be.cc,
    `TRITONBACKEND_ModelInitialize`), which made the CPU default start in 5 s instead of 2 and an engine
    reload take 3 s instead of 0.7. Turn it on for repositories holding models of your own that rely on
    it. Triton's CPU metrics are collected every METRICS_INTERVAL_MS unless `extra_args` name an interval:
    at its default, 2000 ms, the collecting thread, which the server joins as it exits, kept every stop
    0.7-0.9 s longer (cpu-tiny: 2.85-2.95 s from SIGTERM to exit, 2.12-2.14 s at 250 ms). The server gets
    SIGTERM if the thread that started it dies, and its guard (disagg.serve.guard) ends it if that process
    dies and the server has not exited `exit_timeout_s + stop_grace_s` seconds later.
    Use as a context manager (start, wait until ready, stop on exit) or call start/wait_ready/stop.
    """

    stop_grace_s = 10.0  # past the exit timeout, before a server told to stop is killed

    def __init__(
        self,
        model_repository: str | Path,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        address: str | None = "127.0.0.1",
        extra_args: tuple[str, ...] | list[str] = (),
        log_path: str | Path | None = None,
        exit_timeout_s: int | None = 5,
        backend_dir: str | Path | None = None,
        env: dict[str, str] | None = None,
        sweeps_deployment: bool = True,
        label: str | None = None,
        auto_complete: bool = False,
    ):
        self.model_repository = Path(model_repository)
        self.env = dict(env or {})
        self.sweeps_deployment = sweeps_deployment
        self.label = label
        self.crashed_at: float | None = None  # monotonic time of the fatal-signal line (with `label`)
        self.crash_line = ""
        picked = iter(free_ports([http_port, grpc_port, metrics_port].count(None)))
        self.http_port = next(picked) if http_port is None else http_port
        self.grpc_port = next(picked) if grpc_port is None else grpc_port
        self.metrics_port = next(picked) if metrics_port is None else metrics_port
        self.address = address
        self.extra_args = tuple(extra_args)
        self.auto_complete = auto_complete
        self.log_path = Path(log_path) if log_path is not None else None
        self.exit_timeout_s = None if exit_timeout_s is None else exit_timeout_s + serial_unload_s(model_repository)
        self.backend_dir = Path(backend_dir) if backend_dir is not None else None
        self.process: subprocess.Popen | None = None
        self.install: ServerInstall | None = None
        self._workdir: Path | None = None
        self._shm_before: set[str] | None = None  # /dev/shm's names before the server started
        self._guard: subprocess.Popen | None = None

    @property
    def board_key(self) -> str:
        """The key naming this deployment's shared-memory objects (disagg.triton.load_board)."""
        return board_key(self.model_repository)

    @property
    def internal_key(self) -> str:
        """The credential engine models ask of their callers (disagg.triton.credential), for tests and
        benchmarks that call them directly."""
        return internal_key(self.board_key)

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.address in (None, "0.0.0.0") else self.address

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def engine_url(self) -> str:
        """Where an orchestrator reaches the engine models this server serves: its HTTP endpoint
        (disagg.triton.transport)."""
        return f"http://{self.http_url}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        assert self.install is not None, "start() resolves the install first"
        cmd = [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
        ]
        if self.address is not None:
            cmd += [f"--{kind}-address={self.address}" for kind in ("http", "grpc", "metrics")]
        if self.exit_timeout_s is not None:
            cmd.append(f"--exit-timeout-secs={self.exit_timeout_s}")
        backend_dir = self.backend_dir or self.install.backend_dir
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if not self.auto_complete:
            cmd.append("--disable-auto-complete-config")
        if not any(arg.startswith("--metrics-interval-ms") for arg in self.extra_args):
            cmd.append(f"--metrics-interval-ms={METRICS_INTERVAL_MS}")
        return cmd + list(self.extra_args)

    def start(self) -> TritonServer:
        if self.process is not None:
            raise ServerError("this TritonServer was already started")
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} is not a directory")
        if end_orphan_stubs(self.model_repository):  # a killed server's stubs, which still map their regions
            time.sleep(0.2)
        if self.sweeps_deployment:
            sweep(self.board_key)  # what a killed server of this deployment left behind
        self._shm_before = shm_names()
        sweep_workdirs()  # of servers whose starter was killed
        self._workdir = Path(tempfile.mkdtemp(prefix="disagg-tritonserver-"))
        self.install = find_install(self._workdir)
        env = dict(os.environ, **self.install.env)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env[ENGINE_URL_ENV] = self.engine_url
        env.update(self.env)
        out = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
        elif self.label is not None:
            out = subprocess.PIPE
        try:
            self.process = subprocess.Popen(
                self.command(), env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
            )
        finally:
            if out not in (None, subprocess.PIPE):
                out.close()
        try:
            self._start_guard()
        except BaseException:
            self.stop()  # a server nothing would end if this process died
            raise
        if out is subprocess.PIPE:
            threading.Thread(target=self._relay_output, name=f"output-{self.label}", daemon=True).start()
        return self

    @property
    def _stop_wait_s(self) -> float:
        """How long a server told to stop (by `stop`, or by its starter's death) has before it is killed."""
        return (self.exit_timeout_s or 30) + self.stop_grace_s

    def _start_guard(self) -> None:
        """The server's guard (disagg.serve.guard), which ends it if this process dies and it does not stop."""
        orders = Orders(os.getpid(), self.process.pid, self._stop_wait_s, self.board_key,
                        sorted(self._shm_before), not self.sweeps_deployment, str(self._workdir))
        self._guard = subprocess.Popen([sys.executable, "-c", GUARD_MAIN], stdin=subprocess.PIPE, start_new_session=True)
        with self._guard.stdin as orders_in:
            orders_in.write(orders.to_json().encode() + b"\n")

    def _relay_output(self) -> None:
        """Copies the server's (and its stubs') output to ours, prefixed, noting a fatal signal."""
        prefix = f"[{self.label}] ".encode()
        with self.process.stdout as lines:
            for line in lines:
                crash = _SIGNAL_LINE.match(line)
                if crash and int(crash[1]) not in (signal.SIGINT, signal.SIGTERM) and self.crashed_at is None:
                    self.crashed_at, self.crash_line = time.monotonic(), line.decode(errors="replace").strip()
                with _OUTPUT_LOCK, contextlib.suppress(OSError, ValueError):  # our stdout closed: keep draining
                    sys.stdout.buffer.write(prefix + line)
                    sys.stdout.buffer.flush()

    def log_excerpt(self, lines: int = 40) -> str:
        """The log's error lines (a model's load failure scrolls far up behind the shutdown tables),
        then its last `lines` lines."""
        if self.log_path is None or not self.log_path.is_file():
            return "(server output went to the console above)"
        with open(self.log_path, errors="replace") as f:
            text = f.readlines()
        errors = [line for line in text if _GLOG_ERROR.match(line)][-20:]
        return "errors:\n" + "".join(errors) + f"last {lines} lines:\n" + "".join(text[-lines:])

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Polls HTTP `/v2/health/ready` until true and the metrics port accepts connections (Triton starts
        its metrics service some 40 ms after the HTTP one: a scrape right after ready was refused); raises
        ServerError with the log tail if the server exits first or `timeout` seconds pass."""
        import tritonclient.http as httpclient

        assert self.process is not None, "call start() first"
        client = httpclient.InferenceServerClient(self.http_url, connection_timeout=2.0, network_timeout=2.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerError(f"tritonserver exited with code {code} before it was ready:\n{self.log_excerpt()}")
                try:
                    if client.is_server_ready() and self._metrics_listening():
                        return
                except Exception:  # noqa: BLE001 - connection refused/reset while it starts up
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_excerpt()}")
                time.sleep(0.2)
        finally:
            client.close()

    def _metrics_listening(self) -> bool:
        if "--allow-metrics=false" in self.extra_args:
            return True
        try:
            socket.create_connection((self.client_host, self.metrics_port), timeout=2.0).close()
            return True
        except OSError:
            return False

    def is_live(self, timeout_s: float = 2.0) -> bool:
        """Whether the server answers HTTP `/v2/health/live` within `timeout_s`."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/live", timeout=timeout_s) as resp:
                return resp.status == 200
        except (OSError, ValueError):
            return False

    def wait(self) -> int:
        """Blocks until the server exits; its exit code (negative: killed by that signal)."""
        assert self.process is not None, "call start() first"
        return self.process.wait()

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it is still running `exit_timeout_s + stop_grace_s` seconds later.
        Returns the exit code (None if it was never started). Safe to call twice."""
        if self._guard is not None:
            self._guard.kill()
            self._guard.wait()
            self._guard = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self._stop_wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None:
            # Python stubs outlive a server that crashed or was killed: end its whole process group, then
            # remove what they can no longer remove themselves.
            end_server(self.process.pid, self.board_key, self._shm_before, not self.sweeps_deployment, self._workdir)
        elif self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._workdir = None
        return self.process.returncode if self.process is not None else None

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
