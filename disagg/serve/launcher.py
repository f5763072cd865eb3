"""`disagg-serve`: run tritonserver with what the bundled server needs filled in.

    disagg-serve --model-repository model_repository          # HTTP 8000, gRPC 8001, metrics 8002
    disagg-serve --model-repository model_repository --http-port 9000 --grpc-port 9001 \\
        --metrics-port 9002 --model-control-mode=explicit --load-model=ensemble

Takes tritonserver's own flags and passes them on unchanged. Without a tritonserver on PATH it runs the
one bundled in nvidia-pytriton and adds the backend directory, library path and PATH that it needs
(docs/triton-on-cpu.md). Listens on 127.0.0.1 unless an --http-address/--grpc-address/--metrics-address
flag says otherwise. Runs the server with `--model-control-mode=explicit --load-model=*` unless told
another mode, so that a watchdog (disagg.serve.watchdog) can reload an engine model whose instance died.
Once every model is loaded it starts the OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, and `/ready` + `/live` for probes; disagg/openai) on --openai-port, on the same address as
HTTP, then prints "ready". A server that dies on its own, or answers no liveness probe for HUNG_AFTER_S,
is started again on the same ports (`_supervise`);
SIGINT/SIGTERM go to the server; the API stops with it; the exit code is the server's. The server gets
5 s to finish its requests on a stop (--exit-timeout-secs).
"""
from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time

from disagg.serve.openai_front import OpenAIFront
from disagg.serve.server import ServerError, TritonServer
from disagg.serve.watchdog import Watchdog

_PREFIX = "disagg-serve:"
MAX_SERVER_RESTARTS = 5
RESTART_WINDOW_S = 600.0
HUNG_AFTER_S = 15.0  # a server that has not answered /v2/health/live for this long is killed (then restarted)
STOP_GRACE_S = 10.0  # beyond --exit-timeout-secs, for a server told to stop


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="disagg-serve", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is tritonserver's (see tritonserver --help) and is passed on as given.",
    )
    p.add_argument("--model-repository", "--model-store", action="append", required=True, help="as tritonserver")
    p.add_argument("--http-port", type=int, default=8000, help="as tritonserver (default 8000)")
    p.add_argument("--grpc-port", type=int, default=8001, help="as tritonserver (default 8001)")
    p.add_argument("--metrics-port", type=int, default=8002, help="as tritonserver (default 8002)")
    p.add_argument("--backend-directory", help="as tritonserver; default: prepared for the bundled server")
    p.add_argument("--exit-timeout-secs", type=int, default=5, help="as tritonserver (default here 5; tritonserver's own is 30)")
    p.add_argument("--openai-port", type=int, default=9000, help="disagg-serve only: the OpenAI-compatible API's port (default 9000)")
    p.add_argument("--no-openai", action="store_true", help="disagg-serve only: do not start the OpenAI-compatible API")
    p.add_argument(
        "--ready-timeout-secs", type=float, default=600.0,
        help="disagg-serve only: give up when the server is not ready after this long (default 600)",
    )
    return p


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of tritonserver flag `flag` in `args` (`--flag=value` or `--flag value`), None if absent."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def main(argv: list[str] | None = None) -> int:
    args, passthrough = _parser().parse_known_args(argv)
    first, *more = args.model_repository
    chooses_address = any(a.split("=")[0] in ("--http-address", "--grpc-address", "--metrics-address") for a in passthrough)
    control = _flag_value(passthrough, "--model-control-mode")
    if control is None:
        control = "explicit"
        passthrough += ["--model-control-mode=explicit", "--load-model=*"]

    def new_server() -> TritonServer:
        return TritonServer(
            first,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            address=None if chooses_address else "127.0.0.1",
            extra_args=[*(f"--model-repository={r}" for r in more), *passthrough],
            exit_timeout_s=args.exit_timeout_secs,
            backend_dir=args.backend_directory,
        )

    server = new_server()
    try:
        server.start()
    except ServerError as exc:
        print(f"{_PREFIX} error: {exc}", file=sys.stderr)
        return 2
    signalled: list[int] = []
    current = [server]  # the running server, for the signal handler
    watchdog = None
    if control == "explicit":
        import tritonclient.http as httpclient

        watchdog = Watchdog(server.board_key, httpclient.InferenceServerClient(server.http_url),
                            log=lambda line: print(f"{_PREFIX} {line}", flush=True))

    def forward(signum: int, _frame) -> None:
        signalled.append(signum)
        if watchdog is not None:
            watchdog.halt()  # the models are being unloaded on purpose now
        if current[0].process.poll() is None:
            current[0].process.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    print(f"{_PREFIX} {server.install.description}", flush=True)
    print(f"{_PREFIX} {shlex.join(server.command())}", flush=True)
    print(
        f"{_PREFIX} listening on HTTP :{server.http_port}, gRPC :{server.grpc_port}, "
        f"metrics :{server.metrics_port}", flush=True,
    )
    front = None
    try:
        server.wait_ready(args.ready_timeout_secs)
        if watchdog is not None:
            watchdog.start()
        else:
            print(f"{_PREFIX} dead engine models are not reloaded: that needs --model-control-mode=explicit", flush=True)
        if not args.no_openai:
            http_address = next((a.split("=", 1)[1] for a in passthrough if a.startswith("--http-address=")), None)
            front = OpenAIFront(first, server.grpc_url, host=http_address or server.address or "0.0.0.0", port=args.openai_port)
            front.start().wait_ready()
            print(f"{_PREFIX} OpenAI-compatible API on {front.base_url}", flush=True)
        print(f"{_PREFIX} ready", flush=True)
        code = _supervise(current, new_server, signalled, args.ready_timeout_secs)
    except ServerError as exc:
        code = 1
        if not signalled:
            print(f"{_PREFIX} error: {exc}", file=sys.stderr)
    for part in (watchdog, front, current[0]):
        if part is not None:
            part.stop()
    return code if code >= 0 else 128 - code


def _wait(server: TritonServer, signalled: list[int]) -> int:
    """Waits for the server to exit and returns its code. One told to stop that is still running
    `--exit-timeout-secs` + STOP_GRACE_S later is killed; so is one that answers no liveness probe for
    HUNG_AFTER_S (a crash that deadlocks in tritonserver's signal handler leaves a process that serves
    nothing and never exits)."""
    last_live, stop_asked = time.monotonic(), None
    while True:
        try:
            return server.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if signalled:
            stop_asked = stop_asked or now
            if now - stop_asked > (server.exit_timeout_s or 30) + STOP_GRACE_S:
                print(f"{_PREFIX} tritonserver still running {now - stop_asked:.0f} s after the stop; killing it", flush=True)
                server.process.kill()
        elif server.is_live():
            last_live = now
        elif now - last_live > HUNG_AFTER_S:
            print(f"{_PREFIX} tritonserver has answered no liveness probe for {now - last_live:.0f} s; killing it", flush=True)
            server.process.kill()
            last_live = now


def _supervise(current: list[TritonServer], new_server, signalled: list[int], ready_timeout_s: float) -> int:
    """Waits for the server; one that dies on its own (a crash, not a signal from us) or hangs is started again, on
    the same ports, after 1, 2, 4 ... s (at most MAX_SERVER_RESTARTS times within RESTART_WINDOW_S). The
    API and the watchdog carry on: they reach the new server at the same addresses. Returns the exit code."""
    crashes: list[float] = []
    while True:
        code = _wait(current[0], signalled)
        if signalled:
            return code
        now = time.monotonic()
        crashes = [t for t in crashes if now - t < RESTART_WINDOW_S] + [now]
        if len(crashes) > MAX_SERVER_RESTARTS:
            print(f"{_PREFIX} tritonserver exited with code {code} {len(crashes)} times in {RESTART_WINDOW_S:.0f} s; giving up", flush=True)
            return code
        current[0].stop()  # sweeps what the dead server left
        delay = 2.0 ** (len(crashes) - 1)
        print(f"{_PREFIX} tritonserver exited with code {code}; starting it again in {delay:.0f} s (server restart {len(crashes)})", flush=True)
        time.sleep(delay)
        if signalled:
            return code
        current[0] = new_server().start()
        current[0].wait_ready(ready_timeout_s)
        print(f"{_PREFIX} ready again", flush=True)
