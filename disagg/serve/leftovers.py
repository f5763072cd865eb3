"""What a killed server or its killed starter leaves behind (in shared memory, in /tmp), found and removed.

A server stopped in order removes its own objects (engine models withdraw their load-board entries and
unlink their KV pools, the Python backend its regions). One that crashed, or was killed with its stubs,
leaves them behind: the prefill KV pool alone is the size of the KV cache. Everything of a deployment is
named by its board key (`disagg-load-<key>-*`, `disagg-cancel-<key>-*`, `disagg-restarts-<key>`,
`disagg-internal-<key>`, `disagg_<key>_*` KV pools), so `sweep` removes it before a server starts and after it stops. The Python
backend's regions (`triton_python_backend_shm_region_*`) carry no deployment name: one is removed only
when no process maps it, and either it appeared while this server ran (`since`: what was there before it
started) or it is older than REGION_GRACE_S (a region being created is not mapped yet), so another
server's live regions are never touched.

The Python backend also makes an empty `/tmp/python_env_XXXXXX` per server (for conda-packed execution
environments, which these repositories do not use) and removes it only in an orderly shutdown: a server
killed, or one that exits on its exit timeout, leaves it. Which server made one is not recorded, and a
server whose directory is gone aborts at its shutdown (its EnvironmentManager's destructor throws), so
`sweep_python_envs` removes them only while no tritonserver runs at all.

A server's work directory (`/tmp/disagg-tritonserver-*`, its backend directory of links) is removed by
the process that started it, at the server's stop; one killed first leaves it. `sweep_workdirs` removes
those that no running process names on its command line (a server's `--backend-directory`, its stubs'
path), once they are a minute old.

Python backend stubs can outlive their server too: a server that exits on its exit timeout does not wait
for them, and they ignore SIGTERM. `end_orphan_stubs` ends those of a repository (adopted by init) before
a server of it starts, and with them their mappings.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from disagg.triton.load_board import parent_pid, pid_alive, process_group

SHM = Path("/dev/shm")
_BACKEND_REGION = "triton_python_backend_shm_region_"
REGION_GRACE_S = 10.0
TMP = Path("/tmp")
_PYTHON_ENV = "python_env_"
_WORKDIR = "disagg-tritonserver-"
WORKDIR_GRACE_S = 60.0


def _of_every_process(name: str) -> Iterator[str]:
    """/proc/<pid>/<name> of every process, as text; skipped where it exited meanwhile or is not ours to read."""
    for path in Path("/proc").glob(f"[0-9]*/{name}"):
        try:
            yield path.read_bytes().decode(errors="replace")
        except OSError:
            continue


def mapped_names(shm_dir: Path = SHM) -> set[str]:
    """Names of the files in `shm_dir` that some process has mapped (from /proc/*/maps)."""
    prefix = f"{shm_dir}/"
    names = set()
    for text in _of_every_process("maps"):
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                names.add(line[at + len(prefix):].removesuffix(" (deleted)"))
    return names


def names(shm_dir: Path = SHM) -> set[str]:
    return {p.name for p in shm_dir.iterdir()}


def deployment_objects(key: str, shm_dir: Path = SHM, since: set[str] | None = None, regions_only: bool = False) -> list[Path]:
    """The deployment's own objects (unless `regions_only`), and backend regions nobody maps (see the
    module's docstring)."""
    ours = () if regions_only else (f"disagg-load-{key}-", f"disagg-kvindex-{key}-", f"disagg-kvstore-{key}-", f"disagg-cancel-{key}-", f"disagg-restarts-{key}", f"disagg-internal-{key}", f"disagg_{key}_")
    mapped, now = mapped_names(shm_dir), time.time()

    def orphan_region(p: Path) -> bool:
        if not p.name.startswith(_BACKEND_REGION):
            return False
        if since is not None and p.name not in since:
            return True
        try:
            return now - p.stat().st_mtime > REGION_GRACE_S
        except FileNotFoundError:
            return False

    return [p for p in shm_dir.iterdir() if p.name not in mapped and (p.name.startswith(ours) or orphan_region(p))]


def sweep(key: str, shm_dir: Path = SHM, since: set[str] | None = None, settle_s: float = 2.0, regions_only: bool = False) -> list[str]:
    """Removes `deployment_objects`; retries for up to `settle_s` while killed processes still map some.
    Returns the names removed."""
    removed: list[str] = []
    deadline = time.monotonic() + settle_s
    while True:
        for path in deployment_objects(key, shm_dir, since, regions_only):
            try:
                path.unlink()
                removed.append(path.name)
            except FileNotFoundError:
                pass
        held = [] if regions_only else [p for p in shm_dir.iterdir() if p.name.startswith(f"disagg_{key}_")]
        if not held or time.monotonic() > deadline:
            return removed
        time.sleep(0.1)


def servers_running() -> bool:
    """Whether a tritonserver process runs on this machine (among those this user can see)."""
    return any(comm.strip() == "tritonserver" for comm in _of_every_process("comm"))


def sweep_python_envs(tmp_dir: Path = TMP, grace_s: float = REGION_GRACE_S) -> list[str]:
    """Removes the backend's empty environment directories of servers gone (see the module's docstring):
    only while no tritonserver runs, only this user's, only those older than `grace_s` (one being made
    belongs to a server starting). Returns the names removed."""
    if servers_running():
        return []
    removed, now = [], time.time()
    for path in tmp_dir.glob(f"{_PYTHON_ENV}*"):
        try:
            info = path.stat()
            if info.st_uid == os.getuid() and now - info.st_mtime > grace_s:
                path.rmdir()  # refuses a directory that is not empty
                removed.append(path.name)
        except OSError:
            continue
    return removed


def command_lines() -> str:
    """Every running process's command line, joined (those this user can read)."""
    return "\n".join(cmdline.replace("\0", " ") for cmdline in _of_every_process("cmdline"))


def sweep_workdirs(tmp_dir: Path = TMP, grace_s: float = WORKDIR_GRACE_S, in_use: str | None = None) -> list[str]:
    """Removes server work directories whose starter was killed (see the module's docstring): those older
    than `grace_s` (one being made belongs to a server starting) that no command line in `in_use` (default:
    the running processes') names. Returns the names removed."""
    removed, now = [], time.time()
    for path in tmp_dir.glob(f"{_WORKDIR}*"):
        try:
            old = now - path.stat().st_mtime > grace_s
        except OSError:
            continue
        if not old:
            continue
        if in_use is None:
            in_use = command_lines()
        if f"{path}/" not in in_use:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def end_server(pid: int, key: str, since: set[str] | None, regions_only: bool, workdir: Path | None) -> None:
    """SIGKILLs server `pid`'s whole process group (its stubs outlive a server that crashed or was killed),
    waits up to 5 s until nothing of the group runs (a dying stub still maps its region), then removes what the
    server left: its shared memory (`sweep`), the backend's environment directories, its work directory."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while group_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    sweep(key, since=since, regions_only=regions_only)
    sweep_python_envs()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _pids() -> Iterator[int]:
    return (int(p.name) for p in Path("/proc").glob("[0-9]*"))


def children_of(ppid: int) -> list[int]:
    """The processes whose parent is `ppid` (1: those init adopted)."""
    return [pid for pid in _pids() if parent_pid(pid) == ppid]


def group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. Its zombies do not count: a zombie maps nothing, and
    one that init adopted (a stub's helper process that outlived the stub) stays until init reaps it,
    which took up to 1.2 s here."""
    return any(process_group(pid) == pgid and pid_alive(pid) for pid in _pids())


def stubs_of(models: Path, among: Iterable[int] | None = None) -> list[int]:
    """The Python backend stubs (among `among`, by default every process) of the models under `models`: a
    repository, or one model's directory. A stub's first argument is its model's path."""
    prefix = f"{Path(models).resolve()}/"
    found = []
    for pid in _pids() if among is None else among:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub") and argv[1].decode(errors="replace").startswith(prefix):
            found.append(pid)
    return found


def end_orphan_stubs(model_repository: Path) -> list[int]:
    """SIGKILLs Python backend stubs of `model_repository`'s models whose server is gone (parent: init).
    Returns their process ids."""
    ended = []
    for pid in stubs_of(model_repository, children_of(1)):
        try:
            os.kill(pid, signal.SIGKILL)
            ended.append(pid)
        except ProcessLookupError:
            pass
    return ended
