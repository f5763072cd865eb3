"""`disagg-serve`: run tritonserver with what the bundled server needs filled in.

    disagg-serve --model-repository model_repository          # HTTP 8000, gRPC 8001, metrics 8002
    disagg-serve --model-repository model_repository --http-port 9100 --grpc-port 9101 \\
        --metrics-port 9102 --openai-port 9103                 # OpenAI-compatible API on 9103 (default 9000)

Takes tritonserver's own flags and passes them on unchanged. Without a tritonserver on PATH it runs the
one bundled in nvidia-pytriton and adds the backend directory, library path and PATH that it needs
(docs/triton-on-cpu.md). Listens on 127.0.0.1 unless an --http-address/--grpc-address/--metrics-address
flag says otherwise.

Unless told a model-control mode, each reference-engine model runs in a tritonserver of its own, on
private loopback ports, and the rest (ensembles, orchestrators, pre/postprocessing) in the server on the
ports given: in Triton 2.51 a Python stub killed while it holds one of the backend's interprocess locks
aborts the server that runs it, and that must not take the ensembles and every other engine down with
it. The orchestrators reach the engine servers through $DISAGG_ENGINE_URLS. Every server runs with
`--model-control-mode=explicit`, so that a watchdog (disagg.serve.watchdog) can reload an engine model
whose instance died; `--one-server` runs everything in one server instead. Each server's output is
printed prefixed with `[main]` or `[<engine model>]`. Config auto-completion is off
(`--disable-auto-complete-config`: the rendered configs are complete, and with it on each model load
starts one Python stub more), except in a main server given more repositories than the first or a
`--strict-model-config` flag.

Once every model is loaded it starts the OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/ready` + `/live` for probes, and `/metrics` with every server's metrics; disagg/openai)
on --openai-port, on the same address as HTTP, then prints "ready". A server that dies on its own, or
answers no liveness probe, is started again on the same ports (disagg.serve.supervisor).
SIGINT/SIGTERM stop everything; the exit code is the main server's. Servers get 5 s to finish their
requests on a stop (--exit-timeout-secs).

`--load-model=X` flags without a model-control mode serve only those models. `--announce DIR` makes this
server a replica of a pool (one server, disagg.triton.replicas): once ready it lists itself in the
registry DIR, and on SIGINT/SIGTERM it first leaves the registry, waits until orchestrators have
stopped sending it requests and its engines have finished the ones they hold (at most
--exit-timeout-secs), then stops.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from disagg.serve.health import engine_models
from disagg.serve.leftovers import end_orphan_stubs, sweep
from disagg.serve.openai_front import OpenAIFront
from disagg.serve.server import ServerError, TritonServer, free_ports
from disagg.serve.supervisor import PREFIX as _PREFIX
from disagg.serve.supervisor import HUNG_AFTER_S, Supervised
from disagg.serve.watchdog import Watchdog
from disagg.triton import load_board, replicas
from disagg.triton.contract import ENGINE_URLS_ENV
from disagg.triton.credential import internal_key


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
    p.add_argument("--one-server", action="store_true", help="disagg-serve only: run the engine models in the main server too")
    p.add_argument("--announce", metavar="DIR", help="disagg-serve only: serve as a pool replica listed in the registry DIR "
                   "(one server; leaves the registry and drains before it stops)")
    p.add_argument(
        "--hung-after-secs", type=float, default=HUNG_AFTER_S,
        help=f"disagg-serve only: kill and start again a server that answered no liveness probe for this long "
             f"(default {HUNG_AFTER_S:g})",
    )
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


def _models(repository: Path) -> list[str]:
    return sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))


def _take_load_models(args: list[str]) -> tuple[list[str], list[str]]:
    """(the models of tritonserver's --load-model flags in `args`, `args` without them)."""
    models, rest, i = [], [], 0
    while i < len(args):
        if args[i].startswith("--load-model="):
            models.append(args[i].split("=", 1)[1])
        elif args[i] == "--load-model" and i + 1 < len(args):
            models.append(args[i + 1])
            i += 1
        else:
            rest.append(args[i])
        i += 1
    return models, rest


class Servers:
    """The servers of one `disagg-serve`: the main one on the ports given, and one per reference-engine model
    on free loopback ports (none with --one-server, several repositories or the user's own model-control
    mode), each `Supervised`."""

    def __init__(self, args, passthrough: list[str], signalled: list[int]):
        first, *more = args.model_repository
        self.repository = Path(first)
        self.key = load_board.board_key(self.repository)
        chooses_address = any(a.split("=")[0] in ("--http-address", "--grpc-address", "--metrics-address") for a in passthrough)
        self.controlled = _flag_value(passthrough, "--model-control-mode") is None  # else the user steers the models
        if self.controlled:  # --load-model flags then say which models to serve
            only, passthrough = _take_load_models(passthrough)
        else:
            only = []
        isolate = self.controlled and not args.one_server and not more and not args.announce
        # The user's models may rely on config auto-completion; ours do not (TritonServer's auto_complete).
        user_configs = bool(more) or _flag_value(passthrough, "--strict-model-config") is not None
        engines = [e.name for e in engine_models(self.repository) if not only or e.name in only] if isolate else []

        def server(label: str, ports: tuple[int | None, ...], load: list[str], env: dict[str, str], address: str | None, extra: list[str],
                   auto_complete: bool = False):
            return lambda: TritonServer(
                first, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2], address=address,
                extra_args=[*extra, *(["--model-control-mode=explicit", *(f"--load-model={m}" for m in load)] if self.controlled else [])],
                exit_timeout_s=args.exit_timeout_secs, backend_dir=args.backend_directory, env=env, sweeps_deployment=not isolate,
                label=label, auto_complete=auto_complete,
            )

        self.engines: dict[str, Supervised] = {}
        # In one call, and clear of the main server's and the API's ports: none listens yet, so a port picked
        # for one server looks free to the next pick (a server that lost its port to another failed to start).
        picked = iter(free_ports(3 * len(engines), exclude=(args.http_port, args.grpc_port, args.metrics_port, args.openai_port)))
        for name in engines:
            ports = (next(picked), next(picked), next(picked))
            self.engines[name] = Supervised(f"tritonserver of {name}", server(name, ports, [name], {}, "127.0.0.1", []), signalled,
                                            on_restart=lambda name=name: load_board.count_restart(self.key, name),
                                            hung_after_s=args.hung_after_secs)
        urls = ",".join(f"{name}={sup.server.engine_url}" for name, sup in self.engines.items())
        served = only or _models(self.repository)
        front_models = [m for m in served if m not in self.engines] if isolate else (only or ["*"])
        self.main = Supervised("tritonserver", server(
            "main", (args.http_port, args.grpc_port, args.metrics_port), front_models, {ENGINE_URLS_ENV: urls} if urls else {},
            None if chooses_address else "127.0.0.1", [*(f"--model-repository={r}" for r in more), *passthrough],
            user_configs,
        ), signalled, hung_after_s=args.hung_after_secs)
        self.isolated = isolate

    @property
    def supervised(self) -> list[Supervised]:
        return [self.main, *self.engines.values()]

    @property
    def metrics_urls(self) -> dict[str, str]:
        """{server name on the API's /metrics: its metrics URL}"""
        return {"main": self.main.server.metrics_url, **{name: sup.server.metrics_url for name, sup in self.engines.items()}}

    def server_of(self, model: str) -> TritonServer:
        return (self.engines.get(model) or self.main).server

    def start(self, ready_timeout_s: float) -> None:
        if self.isolated:  # each server then sweeps only its own leftovers: the deployment's are swept here
            if end_orphan_stubs(self.repository):
                time.sleep(0.2)  # their mappings go with them
            sweep(self.key)
            internal_key(self.key)  # created once, before any engine asks for it
        for sup in self.supervised:
            sup.server.start()
        for sup in self.supervised:
            sup.server.wait_ready(ready_timeout_s)

    def stop(self) -> None:
        for sup in self.supervised:
            sup.server.stop()
        if self.isolated:
            sweep(self.key)

    def drain(self, timeout_s: float) -> tuple[int, int]:
        """Waits until orchestrators have seen this replica leave its registry (they read it every
        replicas.REFRESH_S) and no engine model here holds a request, or `timeout_s` has passed; returns
        the requests held when it began and those still held then."""
        models = [e.name for e in engine_models(self.repository)]

        def held() -> int:  # as the board says, published every 0.1 s
            return sum(load.in_flight + load.held for m in models if (load := load_board.model_load(self.key, m)) is not None)

        at_start = held()
        waited = min(timeout_s, 4 * replicas.REFRESH_S)
        time.sleep(waited)
        return at_start, replicas.wait_quiet(held, timeout_s - waited, 0.1)


def main(argv: list[str] | None = None) -> int:
    args, passthrough = _parser().parse_known_args(argv)
    if args.announce and not os.environ.get(load_board.BOARD_ENV):
        print(f"{_PREFIX} error: --announce: set {load_board.BOARD_ENV} to a directory of this replica's own: servers of one "
              "repository on one machine otherwise share their load board and shared-memory objects", file=sys.stderr)
        return 2
    signalled: list[int] = []
    servers = Servers(args, passthrough, signalled)
    main_server = servers.main.server
    watchdog = None
    if servers.controlled:
        import tritonclient.http as httpclient

        watchdog = Watchdog(servers.key, lambda model: httpclient.InferenceServerClient(servers.server_of(model).http_url),
                            log=lambda line: print(f"{_PREFIX} {line}", flush=True),
                            crashed=lambda model: servers.server_of(model).crashed_at is not None)

    entry: list[Path] = []  # this replica's registry entry, while it is listed

    def forward(signum: int, _frame=None) -> None:
        if entry:  # a replica leaves its pool and drains first; a second signal stops at once
            entry.pop().unlink(missing_ok=True)
            print(f"{_PREFIX} left the registry {args.announce}: draining", flush=True)

            def drain_then_stop() -> None:
                started = time.monotonic()
                at_start, held = servers.drain(args.exit_timeout_secs)
                print(f"{_PREFIX} drained in {time.monotonic() - started:.1f} s, {at_start} requests held when told to stop"
                      + (f", {held} still held: stopping anyway" if held else ""), flush=True)
                forward(signum)

            threading.Thread(target=drain_then_stop, name="drain", daemon=True).start()
            return
        signalled.append(signum)
        if watchdog is not None:
            watchdog.halt()  # the models are being unloaded on purpose now
        for sup in servers.supervised:
            if sup.server.process is not None and sup.server.process.poll() is None:
                sup.server.process.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    front = None
    try:
        try:
            servers.start(args.ready_timeout_secs)
        except ServerError as exc:
            if not signalled:
                print(f"{_PREFIX} error: {exc}", file=sys.stderr)
            return 2
        print(f"{_PREFIX} {main_server.install.description}", flush=True)
        print(f"{_PREFIX} {shlex.join(main_server.command())}", flush=True)
        print(f"{_PREFIX} listening on HTTP :{main_server.http_port}, gRPC :{main_server.grpc_port}, "
              f"metrics :{main_server.metrics_port}", flush=True)
        for name, sup in servers.engines.items():
            print(f"{_PREFIX} engine model {name} in its own tritonserver on 127.0.0.1: gRPC :{sup.server.grpc_port}, "
                  f"HTTP :{sup.server.http_port}, metrics :{sup.server.metrics_port}", flush=True)
        for name, sup in servers.engines.items():
            threading.Thread(target=sup.run, args=(args.ready_timeout_secs,), name=f"supervise-{name}", daemon=True).start()
        if watchdog is not None:
            watchdog.start()
        else:
            print(f"{_PREFIX} dead engine models are not reloaded: a --model-control-mode given here leaves the models to you "
                  "(leave it out, and disagg-serve runs each engine model in a server of its own and reloads it)", flush=True)
        if not args.no_openai:
            http_address = next((a.split("=", 1)[1] for a in passthrough if a.startswith("--http-address=")), None)
            front = OpenAIFront(servers.repository, main_server.grpc_url, host=http_address or main_server.address or "0.0.0.0",
                                port=args.openai_port, metrics_urls=servers.metrics_urls)
            front.start().wait_ready()
            print(f"{_PREFIX} OpenAI-compatible API on {front.base_url}", flush=True)
        if args.announce and not signalled:
            entry.append(replicas.announce(args.announce, replicas.Replica(main_server.engine_url, main_server.metrics_url)))
            print(f"{_PREFIX} listed in the registry {args.announce} as {main_server.engine_url}", flush=True)
        print(f"{_PREFIX} ready", flush=True)
        code = servers.main.run(args.ready_timeout_secs)
    except ServerError as exc:
        code = 1
        if not signalled:
            print(f"{_PREFIX} error: {exc}", file=sys.stderr)
    finally:
        for path in entry:  # the server ended on its own: it serves nobody now
            path.unlink(missing_ok=True)
        if watchdog is not None:
            watchdog.stop()
        if front is not None:
            front.stop()
        servers.stop()
    return code if code >= 0 else 128 - code
