"""Engine instances publish their load and that they are alive; the orchestrator reads it to send each
request to the least loaded live instance and to fail a request fast when the instance serving it dies,
the watchdog to bring a dead instance back, the readiness check to tell the truth.

A board is a directory of small JSON files, one per engine instance, rewritten atomically every
refresh (default: /dev/shm, i.e. memory), carrying the instance's process id. The board key is derived
from the model repository's path, so two servers on one machine never read each other's load.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path

from disagg.atomic_file import replace_file

STALE_S = 2.0


BOARD_ENV = "DISAGG_LOAD_BOARD"


def board_dir() -> Path:
    return Path(os.environ.get(BOARD_ENV) or "/dev/shm")


def board_key(repository_root: Path) -> str:
    """Names a deployment's objects. A server given a board of its own ($DISAGG_LOAD_BOARD) serves a
    deployment of its own, even from a repository another server on the machine serves (pool replicas)."""
    ident = str(Path(repository_root).resolve())
    if os.environ.get(BOARD_ENV):
        ident += "\0" + str(board_dir().resolve())
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Load:
    in_flight: int
    free_blocks: int
    updated: float
    pid: int = 0  # the engine instance's process (its Python backend stub)
    scheduled: int = 0  # in the batch
    in_context: int = 0  # in the batch, prompt not yet computed
    active: int = 0  # in the batch or claiming their KV: TensorRT-LLM's active requests (not the queued)
    held: int = 0  # context phases done, their KV held for a decode to take
    blocks_total: int = 0
    max_batch_size: int = 0


@dataclass(frozen=True)
class Entry:
    """One instance's latest publication."""

    model: str
    instance: str
    load: Load

    @cached_property
    def process_alive(self) -> bool:
        """Asked once per Entry: an entry is one read of the board."""
        return pid_alive(self.load.pid)

    @property
    def fresh(self) -> bool:
        return time.time() - self.load.updated < STALE_S


def _read_small(path: str) -> bytes:
    """A small file's bytes in three system calls (Path.read_text makes twice as many; each costs tens of µs
    in a sandboxed container, and an orchestrator serving requests reads the board ten times a second)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state, parent pid, ...); None when there is
    no such process."""
    if pid <= 0:
        return None
    try:
        fields = _read_small(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 1 else None


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` in /proc (R, S, D, T for stopped, Z for a zombie ...); None when
    there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[0].decode()


def parent_pid(pid: int) -> int | None:
    """Process `pid`'s parent (1 once init adopted it); None when there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def process_group(pid: int) -> int | None:
    """Process `pid`'s process group; None when there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[2])


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed stub stays one until Triton reaps it)."""
    return process_state(pid) not in (None, "Z")


class Liveness:
    """`pid_alive` for many threads at once, each process looked up at most once per `max_age_s`: every
    request in flight checks the engine instances serving it every 50 ms, 1,300 /proc reads a second at
    64 requests otherwise."""

    def __init__(self, max_age_s: float = 0.05):
        self.max_age_s = max_age_s
        self._seen: dict[int, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def alive(self, pid: int) -> bool:
        now = time.monotonic()
        with self._lock:
            at, alive = self._seen.get(pid, (-float("inf"), False))
        if now - at > self.max_age_s:
            alive = pid_alive(pid)
            with self._lock:
                self._seen[pid] = (now, alive)
        return alive


def _path(key: str, model: str, instance: str) -> Path:
    return board_dir() / f"disagg-load-{key}-{model}-{instance}.json"


def publish(key: str, model: str, instance: str, in_flight: int, free_blocks: int, **more: int) -> None:
    """`more`: Load's other counts (scheduled, in_context, active, held, blocks_total, max_batch_size)."""
    load = Load(in_flight, free_blocks, time.time(), os.getpid(), **more)
    replace_file(_path(key, model, instance), json.dumps(asdict(load)).encode())


def served_elsewhere(key: str, model: str, instance: str) -> int | None:
    """The tritonserver that serves `model`'s `instance` on this board from another process tree, if one does: its
    entry is fresh and was published by a live process whose parent (its server) is not ours. Two servers started from
    one repository without boards of their own would read and overwrite each other's load and liveness, and the second
    would remove the first's KV pools as a killed predecessor's. A predecessor whose server was killed has no live
    process, or one that init or a subreaper adopted (a parent that is not a tritonserver)."""
    entry = _entry(str(_path(key, model, instance)), model, instance)
    if entry is None or not entry.fresh or not entry.process_alive:
        return None
    server = parent_pid(entry.load.pid)
    if server in (None, 1, os.getppid()):
        return None
    try:  # a stub another process adopted (a subreaper) has outlived its server, and is about to exit
        return server if _read_small(f"/proc/{server}/comm").strip() == b"tritonserver" else None
    except OSError:
        return None


def _entry(path: str, model: str, instance: str) -> Entry | None:
    """The entry at `path`; None where there is none, or it is being replaced right now, or is not ours."""
    try:
        return Entry(model, instance, Load(**json.loads(_read_small(path))))
    except (OSError, ValueError, TypeError):
        return None


def entries(key: str, model: str | None = None) -> list[Entry]:
    """What every instance of `model` (None: of every model) last published. Names hold no "-", so a
    file's name splits into model and instance there."""
    ours = f"disagg-load-{key}-"
    prefix = f"{ours}{model}-" if model else ours
    found = []
    with os.scandir(board_dir()) as listing:
        files = [(e.name, e.path) for e in listing if e.name.startswith(prefix) and e.name.endswith(".json")]
    for name, path in files:
        owner, instance = name[len(ours):-len(".json")].split("-", 1)
        if model and owner != model:
            continue  # a model whose name starts with `model`, e.g. decode_1 for decode
        entry = _entry(path, owner, instance)
        if entry is not None:
            found.append(entry)
    return found


def withdraw(key: str, model: str, instance: str) -> None:
    _path(key, model, instance).unlink(missing_ok=True)


def model_load(key: str, model: str) -> Load | None:
    """The model's load summed over its live instances; None when none published recently."""
    loads = [e.load for e in entries(key, model) if e.fresh and e.process_alive]
    if not loads:
        return None
    counts = [f.name for f in fields(Load) if f.name not in ("updated", "pid")]  # every count adds up; pid is one process's
    return Load(**{c: sum(getattr(x, c) for x in loads) for c in counts}, updated=max(x.updated for x in loads))


class BoardView:
    """The board as one reader sees it, read again every `max_age_s`. Instances publish every 0.1 s, so a read
    that old tells about as much as a fresh one (the orchestrator's own dispatch counts cover what it sent
    since), and the orchestrator asks several times per request (liveness of both roles, the least loaded
    instance of each). A read with its /proc checks costs 0.15 ms here, 0.25 ms in a stub woken from idle:
    once `start`ed, a thread of the view's own reads, so a request's way to its first token never waits for
    one (a caller still reads itself when the last reading is over twice `max_age_s` old: the thread fell behind). The thread stops reading
    once nobody has asked for `idle_after_s`, since those reads cost an idle orchestrator 5-6 ms of CPU a
    second here, and the first request after that reads itself. A hop watches its instances' processes
    itself (`Liveness`), so a death is still noticed within 0.1 s."""

    def __init__(self, key: str, max_age_s: float = 0.1, idle_after_s: float = 10.0):
        self.key, self.max_age_s, self.idle_after_s = key, max_age_s, idle_after_s
        self._lock = threading.Lock()
        self._read_at = self._asked_at = -float("inf")
        self._by_model: dict[str, list[Entry]] = {}
        self._closed = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> BoardView:
        self._reader = threading.Thread(target=self._read_every, name="load-board", daemon=True)
        self._reader.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def entries(self, model: str) -> list[Entry]:
        late_s = 2 * self.max_age_s if self._reader is not None else self.max_age_s
        with self._lock:
            self._asked_at = time.monotonic()
            if self._asked_at - self._read_at > late_s:
                self._read_at, self._by_model = self._read()
            return self._by_model.get(model, [])

    def _read_every(self) -> None:
        while not self._closed.wait(self.max_age_s):
            if time.monotonic() - self._asked_at > self.idle_after_s:
                continue
            try:
                read_at, by_model = self._read()
            except Exception:  # noqa: BLE001 - no board directory, say: a caller's own read raises it where it is reported
                continue
            with self._lock:
                if read_at > self._read_at:  # else a caller read while this one ran
                    self._read_at, self._by_model = read_at, by_model

    def _read(self) -> tuple[float, dict[str, list[Entry]]]:
        read_at, by_model = time.monotonic(), {}
        for entry in entries(self.key):
            entry.process_alive  # asked now, by the reader: the answer stays with the entry
            by_model.setdefault(entry.model, []).append(entry)
        return read_at, by_model


def load_score(board: BoardView, model: str, dispatched: int) -> tuple[bool, int, int]:
    """(an instance is known dead, sequences in flight, -free KV blocks) of `model`: the least of these
    is the least loaded. `dispatched` counts requests the asking orchestrator sent there and still streams,
    which covers the time before the board shows them."""
    published = board.entries(model)  # liveness and load from the same read
    live = [e.load for e in published if e.fresh and e.process_alive]
    dead = any(e.load.pid and not e.process_alive for e in published)
    in_flight = max(sum(x.in_flight for x in live), dispatched)
    return dead, in_flight, -sum(x.free_blocks for x in live)


def _restarts_path(key: str) -> Path:
    return board_dir() / f"disagg-restarts-{key}.json"


def restarts(key: str) -> dict[str, int]:
    """How many times each model was reloaded after an instance died (disagg.serve.watchdog)."""
    try:
        return json.loads(_restarts_path(key).read_text())
    except (OSError, ValueError):
        return {}


def count_restart(key: str, model: str) -> None:
    counts = restarts(key)
    counts[model] = counts.get(model, 0) + 1
    replace_file(_restarts_path(key), json.dumps(counts).encode())
