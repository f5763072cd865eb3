"""CPU seconds of the tritonservers this process runs and of their Python models, sampled in the background,
so that a run's share can be read afterwards for the window its requests were in flight (the servers and
their stubs are gone by then)."""
from __future__ import annotations

import bisect
import os
import threading
import time

import psutil

from disagg.bench.front import cpu_seconds

PERIOD_S = 0.05
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")  # the kernel counts a process's CPU time in whole ticks


class ServerCpu:
    """`with ServerCpu() as cpu: ...` then `cpu.between(t0, t1)`: {process: CPU seconds} over that wall-clock
    (time.time) window, processes named as `bench front` names them ("tritonserver", "stub <model>")."""

    def __init__(self):
        self._times: list[float] = []
        self._totals: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="server-cpu", daemon=True)

    def __enter__(self) -> ServerCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU used from the last sample at or before `t0` to the first at or after `t1`."""
        i = max(0, bisect.bisect_right(self._times, t0) - 1)
        j = min(len(self._times) - 1, bisect.bisect_left(self._times, t1))
        if j <= i:
            return {}
        start, end = self._totals[i], self._totals[j]
        return {name: seconds - start.get(name, 0.0) for name, seconds in end.items()}

    def _sample(self) -> None:
        while not self._stop.wait(PERIOD_S):
            totals: dict[str, float] = {}
            for child in psutil.Process().children(recursive=True):
                try:
                    if child.name() != "tritonserver":
                        continue
                    for name, seconds in cpu_seconds(child.pid).items():
                        if name != "client":
                            totals[name] = totals.get(name, 0.0) + seconds
                except psutil.Error:  # a server that has just exited
                    continue
            self._times.append(time.time())
            self._totals.append(totals)
