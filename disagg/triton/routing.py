"""Where each of the orchestrator's hops goes, and the connection it goes over.

Every engine instance is a model of its own (a `stop` acts only on the instance it lands on), so a hop
picks one: the least loaded (fewest sequences in flight, then most free KV blocks, as the reference
engines publish on the load board), or for prefill the one with the least to compute given the prompt
blocks it holds cached. An engine model whose `engine_urls` entry names pools (disagg.triton.replicas)
is served by each of their live replicas, each counted as an instance with the load its metrics
publish. With service classes, a hop goes to the cheapest pool predicted to meet its class instead
(disagg.triton.sla); `pool_routing` least_loaded and round_robin ignore the class, as baselines.

What this orchestrator dispatched and still streams counts as load at once, before any board shows it.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import numpy as np

from disagg.engine.kv_cache import block_hashes
from disagg.triton import kv_index, load_board, replicas, sla
from disagg.triton.hop import Engine, HopError
from disagg.triton.metrics import TPOT_BUCKETS, TTFT_BUCKETS, Metrics
from disagg.triton.transport import Server, connect


class Router:
    def __init__(self, engine_urls: dict[str, str], prefills: list[str], decoders: list[str], board: load_board.BoardView,
                 index: kv_index.IndexReader, metrics: Metrics, prefill_routing: str, pool_routing: str,
                 classes: dict[str, sla.ServiceClass], default_class: str):
        """`engine_urls`: model -> its server's URL, or pools: "source[;cost=N]|source[;cost=N]...". Without
        `prefills` and `decoders` (aggregated), every model of `engine_urls` serves both phases."""
        self.engine_urls, self.prefills, self.decoders = engine_urls, prefills, decoders
        self.board, self.kv_index = board, index
        self.prefill_routing, self.pool_routing = prefill_routing, pool_routing
        self.dispatched: dict[Engine, int] = {}
        self.rng = random.Random(0)
        self._turn = 0  # pool_routing: round_robin
        self._lock = threading.Lock()
        self.servers: dict[str, Server] = {}  # by URL
        self.retired: list[Server] = []  # of replicas that left (`retire`d, closed at `close`)
        self.pools: dict[str, replicas.ReplicaPool] = {}  # by source
        self.pools_of: dict[str, list[str]] = {}  # model -> the sources of the pools that serve it
        self.costs: dict[str, float] = {}  # source -> relative cost of a hop there (default 1)
        for model, url in engine_urls.items():
            for part in url.split("|"):
                value, _, options = part.partition(";")
                source = replicas.parse_source(value)
                if source is None:
                    continue
                if value not in self.pools:
                    self.pools[value] = replicas.ReplicaPool(source, on_leave=self._replica_left)
                    self.costs[value] = float(options.removeprefix("cost=")) if options.startswith("cost=") else 1.0
                self.pools_of.setdefault(model, []).append(value)
        self.classes, self.default_class = classes, default_class
        self.strictest = {phase: min((t for c in classes.values() if (t := c.target(phase))), default=None)
                          for phase in ("prefill", "decode")}
        self.speeds: dict[str, dict[str, sla.Speed]] = {"prefill": {}, "decode": {}}  # phase -> {pool or url: speed}
        # What class routing sees, for an operator: each pool's measured hops (labelled with its source or
        # URL) and each class's refusals.
        every = list(engine_urls)
        phase_models = {"prefill": prefills or every, "decode": decoders or every}
        self.hop_seconds = {
            (phase, site): metrics.histogram(f"disagg_pool_{metric}_seconds", f"{what}, as service-class routing measures it",
                                             buckets, {"pool": site})
            for phase, metric, what, buckets in (("prefill", "ttft", "Time to first token of a hop to the pool", TTFT_BUCKETS),
                                                 ("decode", "tpot", "Time per output token of a hop to the pool", TPOT_BUCKETS))
            for site in dict.fromkeys(s for m in phase_models[phase] for s in self.pools_of.get(m, [engine_urls[m]]))
        } if classes else {}
        self.refused = {name: metrics.counter("disagg_service_class_refused_total", "Requests refused before any work: no pool "
                                              "was predicted to meet their class", {"service_class": name}) for name in classes}

    # --- engines and their load

    def candidates(self, models: list[str]) -> list[Engine]:
        """Every engine that can serve one of `models`: its server, or each live replica of its pool.
        When none is live, the pools are read again at once (a replica may have joined since their last
        reading, as at start); HopError when there is still none."""
        found = self._listed(models)
        if not found:
            for source in dict.fromkeys(s for m in models for s in self.pools_of[m]):
                self.pools[source].refresh()
            found = self._listed(models)
        if not found:
            sources = ", ".join(sorted({self.engine_urls[m] for m in models}))
            raise HopError(f"{'/'.join(models)}: no replica is serving ({sources}): retry shortly", engine_away=True)
        return found

    def _listed(self, models: list[str]) -> list[Engine]:
        """The engines serving `models` as last read: a model's own server, or each live replica of its pools."""
        found = []
        for model in models:
            sources = self.pools_of.get(model)
            if sources is None:
                found.append(Engine(model, self.engine_urls[model]))
            else:
                found += [Engine(model, url, source) for source in sources for url in self.pools[source].urls()]
        return found

    def check_live(self, models: list[str]) -> dict[int, str]:
        """The live instances' pids of `models` (as published); HopError when instances published and every
        one has died (Triton would hold a request for a dead stub for seconds before refusing it), or when
        no pool of theirs has a live replica."""
        self.candidates(models)
        published = [e for m in models if m not in self.pools_of for e in self.board.entries(m)]
        pids = {e.load.pid: e.instance for e in published if e.process_alive}
        if published and not pids:
            dead = ", ".join(f"{e.instance} (pid {e.load.pid})" for e in published)
            raise HopError(f"{'/'.join(models)}: no live engine instance ({dead} died; it is being reloaded): retry shortly",
                           engine_away=True)
        return pids

    def _score(self, engine: Engine) -> tuple[bool, int, int]:
        """(known dead, sequences in flight, -free KV blocks): from the load board for a model's own
        server, from the replica's metrics for a pool's; what was dispatched there and still streams counts
        even before either shows it. The caller holds `_lock`."""
        dispatched = self.dispatched.get(engine, 0)
        if not engine.replica:
            return load_board.load_score(self.board, engine.model, dispatched)
        load = self.pools[engine.pool].load(engine.url, engine.model)
        if load is None:  # it left the pool since the candidates were listed
            return True, dispatched, 0
        return False, max(load.active, dispatched), -load.free_blocks

    # --- picking one: each pick counts as dispatched until its `done`

    def pick(self, models: list[str], candidates: list[Engine] | None = None) -> Engine:
        """The least loaded engine serving one of `models` (of `candidates`, when the caller listed them)."""
        candidates = candidates or self.candidates(models)
        with self._lock:
            return self._dispatch(min(candidates, key=self._score))

    def pick_decode(self) -> Engine:
        """A decode hop without class routing: the least loaded engine, or each in turn (pool_routing:
        round_robin, a baseline that ignores load and speed)."""
        if self.pool_routing != "round_robin":
            return self.pick(self.decoders)
        candidates = sorted(self.candidates(self.decoders), key=lambda e: (e.pool, e.url, e.model))
        with self._lock:
            self._turn += 1
            return self._dispatch(candidates[self._turn % len(candidates)])

    def pick_prefill(self, prompt: np.ndarray) -> Engine:
        """`least_loaded` as `pick`; `random`; or `cache_aware` (the default): the prefill instance that
        would have the least to do, counting the prompt blocks it must compute (those past the longest
        prefix it holds cached, disagg.triton.kv_index) plus a whole prompt for each request it already has
        in flight, as Dynamo's KV router weighs overlap against load."""
        candidates = self.candidates(self.prefills)
        if self.prefill_routing == "cache_aware" and len(candidates) > 1:
            costs = self._cache_aware_costs(prompt, candidates)
            if costs:  # else every instance is known dead: the least loaded, which the hop then refuses by name
                with self._lock:
                    return self._dispatch(min(costs, key=costs.get))
        elif self.prefill_routing == "random":
            with self._lock:
                return self._dispatch(self.rng.choice(candidates))
        return self.pick(self.prefills, candidates)

    def _cache_aware_costs(self, prompt: np.ndarray, candidates: list[Engine]) -> dict[Engine, int]:
        """{prefill engine not known dead: prompt blocks to compute there + a whole prompt per request in
        flight}. A pool's replicas publish no cache index here: for them the prompt counts whole."""
        costs, hashes_of = {}, {}  # hashes per block size: instances usually share one
        for engine in candidates:
            with self._lock:
                dead, in_flight, _ = self._score(engine)
            if dead:
                continue
            tpb, held = (0, set()) if engine.replica else self.kv_index.held(engine.model)
            if tpb not in hashes_of:
                hashes_of[tpb] = block_hashes(prompt[:-1].tolist(), tpb) if tpb else []
            hashes = hashes_of[tpb]
            matched = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            blocks = max(1, len(hashes))
            costs[engine] = (blocks - matched) + in_flight * blocks
        return costs

    def _dispatch(self, engine: Engine) -> Engine:
        """Counts `engine` as dispatched (until `done`); the caller holds `_lock`."""
        self.dispatched[engine] = self.dispatched.get(engine, 0) + 1
        return engine

    def done(self, engine: Engine) -> None:
        """A hop picked here has ended."""
        with self._lock:
            self.dispatched[engine] -= 1
            if self.dispatched[engine] or not engine.replica or engine.url in self.pools[engine.pool].urls():
                return
            del self.dispatched[engine]
        self._replica_left(engine.url)

    # --- service classes (disagg.triton.sla)

    def service_class(self, value: np.ndarray | None) -> sla.ServiceClass | None:
        """The request's class: its `service_class` input or request parameter, else the spec's default; None
        without classes."""
        name = value.reshape(-1)[0] if value is not None else b""
        name = (name.decode(errors="replace") if isinstance(name, bytes) else str(name)) or self.default_class
        if not name:
            return None
        if name not in self.classes:
            known = ", ".join(self.classes) or "none: orchestrator.service_classes is not set"
            raise HopError(f"service_class: {name!r} is not a service class of this deployment ({known})")
        return self.classes[name]

    def admit(self, klass: sla.ServiceClass, choice: Callable[[], tuple[Engine, int]]) -> tuple[Engine, int]:
        """`choice()`; a NoPoolMeets from it refuses the request (counted for its class)."""
        try:
            return choice()
        except sla.NoPoolMeets as exc:
            self.refused[klass.name].increment(1)
            raise HopError(str(exc)) from None

    def choose(self, models: list[str], klass: sla.ServiceClass, phases: tuple[str, ...]) -> tuple[Engine, int]:
        """Where a hop of `klass` goes and the requests in flight there, not dispatched: a hop of one phase, or
        of both on an aggregated engine. sla.NoPoolMeets when no pool is predicted to meet the class."""
        candidates = self.candidates(models)
        with self._lock:
            scored = [(e, self._score(e)) for e in candidates]
            live = [(e, s) for e, s in scored if not s[0]] or scored
            options = [sla.Option(e, e.site, self.costs.get(e.pool, 1.0), s[1], s) for e, s in live]
        option = sla.choose(options, klass, [sla.Phase(p, self.speeds[p], self.strictest[p]) for p in phases],
                            "aggregated" if len(phases) > 1 else phases[0])
        return option.key, option.in_flight

    def pick_for(self, models: list[str], klass: sla.ServiceClass, phases: tuple[str, ...]) -> tuple[Engine, int]:
        """`choose`, dispatched."""
        engine, in_flight = self.choose(models, klass, phases)
        with self._lock:
            return self._dispatch(engine), in_flight

    def observe(self, phase: str, engine: Engine, in_flight: int, seconds: float) -> None:
        """What a hop took, for its pool's (or server's) speed: TTFT of a prefill hop against the requests
        in flight there when it was sent (itself included), TPOT of a decode one against the mean of that
        and those in flight as it ends. Called before the hop's `done`."""
        if not self.classes:
            return
        load = in_flight + 1
        if phase == "decode":
            with self._lock:
                load = (load + self._score(engine)[1]) / 2
        self.speeds[phase].setdefault(engine.site, sla.Speed()).observe(load, seconds)
        if (phase, engine.site) in self.hop_seconds:
            self.hop_seconds[(phase, engine.site)].observe(seconds)

    def probe_tpot(self, engine: Engine, measured_at: int | None, first_at: float | None, before: int, after: int,
                   ended: bool = False) -> None:
        """Measures a hop's time per output token once (`measured_at` None: not routed by class): as its
        token count passes sla.PROBE_TOKENS (a slow pool is known within a few of its steps), or when it
        ends shorter than that."""
        if measured_at is None or after < 2:
            return
        if before <= sla.PROBE_TOKENS < after or (ended and after <= sla.PROBE_TOKENS):
            self.observe("decode", engine, measured_at, (time.monotonic() - first_at) / (after - 1))

    # --- connections

    def server(self, url: str) -> Server:
        """The client of the engine server at `url`, made on first use."""
        with self._lock:
            if url not in self.servers:
                self.servers[url] = connect(url)
            return self.servers[url]

    def stopped(self, engine: Engine) -> None:
        """A `stop` went to `engine`: if it is a replica that left its pool, the stop opened its channel
        again, so let go of it once more."""
        if engine.replica and engine.url not in self.pools[engine.pool].urls():
            self._replica_left(engine.url)

    def _replica_left(self, url: str) -> None:
        """Lets go of a replica that left its pool once nothing of ours runs there: it cannot stop while a
        stream or connection of ours is open. Until then `done` calls again as its requests end. Nothing is
        cancelled (`retire`: a gRPC stream is half-closed; an HTTP connection closes with its answer); the
        server's client is closed at `close`."""
        with self._lock:
            if any(e.url == url and n for e, n in self.dispatched.items()):
                return
            for engine in [e for e in self.dispatched if e.url == url]:
                del self.dispatched[engine]
            server = self.servers.pop(url, None)
            if server is not None:
                self.retired.append(server)
        if server is not None:
            server.retire()

    def close(self) -> None:
        self.board.close()
        for pool in self.pools.values():
            pool.close()
        with self._lock:
            servers = [*self.servers.values(), *self.retired]
        for server in servers:
            server.close()
