"""Engine steps alone and beside a second process: what co-located processes cost an engine's steps here.

The planner (disagg.planner.simulate, `Host`) shares this machine's cores between the engines' steps as
Linux shares cores between runnable threads, and models nothing more: no slowdown from the caches and memory
bus processes share. This measures that assumption on the bench model: decode steps (a batch of
generation-only sequences over imported contexts, as the decode role runs them) timed alone and while a
second process prefills prompts back to back, streams through 64 MB of memory (as the processes that carry
tokens touch theirs, on a smaller scale) or runs a Python loop that touches almost none; then whole-prompt
steps alone and while the second process decodes; last, decode steps while two other processes keep the two
cores oversubscribed, as a split of three engine instances does here: one prefilling and one decoding (prefill
x2 + decode x1's or aggregated's mix), then two decoding (prefill x1 + decode x2's). Rounds
alternate between the two conditions so that a drift in the machine's speed hits both; "alone" starts only
once the other processes have finished the work they had begun. Printed as p50 and p90 of each condition:
the slowdown comes in spells (decode steps beside a prefill have run x1.7 for one round of eight and x1.0-1.1
in the others here), which a median alone would hide; and the CPU the timed thread spent per step, which the
wall time exceeds once the cores are oversubscribed and which itself grows when the step is sliced (beside two
busy engines here: x1.05-1.18 from batch 1 to 4 over 540-1024-token contexts; beside one: x0.98-1.10).
One BLAS thread per process, as the load tests serve.

    python -m disagg.bench corun                     # bench-100mb, batch 4 over 1024-token contexts
    python -m disagg.bench corun --batch 28 --context 256   # a decode batch as the splits runs reach
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from disagg.bench.engine import build_engine
from disagg.engine.engine import LLMEngine
from disagg.planner.profile import Profiler

READY_TIMEOUT_S = 300.0  # the second process loading its engine and prefilling its context, or filling its memory
IDLE_TIMEOUT_S = 60.0  # the second process finishing the burst of work it had begun
MEMORY_BYTES = 64 << 20  # what the memory-streaming process walks through: twice the L3 cache here


def _busy(engine_dir: Path, work: str, context: int, batch: int, go, idle, stop) -> None:
    """The second process: while `go` is set, does `work` in short bursts: prefills `context`-token prompts,
    decodes `batch` sequences, streams through MEMORY_BYTES or loops in Python; `idle` is set while it does
    nothing (first once it is ready)."""
    with threadpool_limits(1, user_api="blas"):
        if work in ("prefill", "decode"):
            p = Profiler(LLMEngine(engine_dir))
            prompt, phase = p.prefilled(context)
        else:
            buffer = np.ones(MEMORY_BYTES // 4, dtype=np.float32)
        idle.set()
        while not stop.is_set():
            if not go.wait(0.05) or stop.is_set():
                continue
            idle.clear()
            if work == "prefill":
                p.engine.release(p.prompt_steps(context, "context_only"))
                p.steps.clear()
            elif work == "decode":
                ids = p.import_batch(batch, prompt, phase, 40)
                for _ in range(30):
                    p.engine.step()
                for req_id in ids:
                    p.engine.abort(req_id)
                p.steps.clear()
            elif work == "memory":
                for _ in range(20):
                    buffer *= 1.0000001
            else:
                total = 0
                for i in range(200_000):
                    total += i
            idle.set()


def _wait(done, other, timeout_s: float, what: str) -> None:
    """Until `done()`; RuntimeError if the second process has exited, or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not other.is_alive():
            raise RuntimeError(f"the second process exited (code {other.exitcode}) before it could {what}")
        if done():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the second process did not {what} within {timeout_s:g} s")
        time.sleep(0.01)


@dataclass
class Timings:
    """Per condition ("alone", "beside"): the wall seconds of each timed step, and the CPU seconds the timing
    thread spent per step in each round."""

    wall: dict[str, list[float]] = field(default_factory=lambda: {"alone": [], "beside": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {"alone": [], "beside": []})


def step_seconds(engine_dir: Path, timed: str, context: int, batch: int, rounds: int, beside: tuple[str, ...]) -> Timings:
    """This process's `timed` steps ("decode": batch `batch` over `context`-token contexts; "prefill": one
    `context`-token prompt) with the other processes idle, then each busy with its work in `beside` (`_busy`'s),
    `rounds` times."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no BLAS thread pool inherited mid-state
    go, stop = ctx.Event(), ctx.Event()
    idles = [ctx.Event() for _ in beside]
    others = [ctx.Process(target=_busy, args=(engine_dir, work, context, batch, go, idle, stop), daemon=True)
              for work, idle in zip(beside, idles)]
    for other in others:
        other.start()
    timings = Timings()

    def wait_all(done, what: str, timeout_s: float) -> None:
        for other, idle in zip(others, idles):
            _wait(lambda: done(idle), other, timeout_s, what)

    try:
        with threadpool_limits(1, user_api="blas"):
            p = Profiler(LLMEngine(engine_dir))
            prompt, phase = p.prefilled(context)
            wait_all(lambda idle: idle.is_set(), "get ready", READY_TIMEOUT_S)
            for _ in range(rounds):
                for condition in ("alone", "beside"):
                    if condition == "alone":
                        go.clear()
                        wait_all(lambda idle: idle.is_set(), "finish its work", IDLE_TIMEOUT_S)
                    else:
                        go.set()
                        wait_all(lambda idle: not idle.is_set(), "start computing", IDLE_TIMEOUT_S)
                    p.steps.clear()
                    ids = p.import_batch(batch, prompt, phase, 20) if timed == "decode" else []  # its step untimed
                    cpu = time.thread_time()
                    if timed == "decode":
                        for _ in range(12):
                            p.timed_step()
                    else:
                        p.engine.release(p.prompt_steps(context, "context_only"))
                    cpu = time.thread_time() - cpu
                    for req_id in ids:
                        p.engine.abort(req_id)
                    timings.wall[condition] += [s.seconds for s in p.steps]
                    timings.cpu[condition].append(cpu / len(p.steps))
    finally:
        stop.set()
        for other in others:
            other.join(timeout=IDLE_TIMEOUT_S)
            if other.is_alive():
                other.kill()
                other.join()
    return timings


def decode_interference(engine_dir: Path, cores: int, context: int = 512, batch: int = 4, rounds: int = 6) -> tuple[float, float, float]:
    """What the planner's `Host.decode_interference` stands for, measured: decode steps timed alone and beside two
    other decoding processes. Returns the ratio of their p50 wall times, the part of it that sharing `cores` between
    the three processes explains, and how much of the rest falls to each other process (at least 0). Here x1.62,
    x1.91 and x1.94 in three readings (batch 4, 512-token contexts) where two cores shared by three explain x1.5:
    4-15% each."""
    others = ("decode", "decode")
    t = step_seconds(engine_dir, "decode", context, batch, rounds, others)
    ratio = float(np.median(t.wall["beside"]) / np.median(t.wall["alone"]))
    shared = max(1.0, (len(others) + 1) / cores)
    return ratio, shared, max(0.0, (ratio / shared - 1) / len(others))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench corun", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("build"), help="where checkpoints and engines are cached")
    p.add_argument("--preset", default="bench-100mb")
    p.add_argument("--context", type=int, default=1024, help="prompt and context length (tokens)")
    p.add_argument("--batch", type=int, default=4, help="decode batch")
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args(argv)
    engine_dir = build_engine(a.root, a.preset, a.batch, a.context, 64)
    print(f"co-run on {a.preset}: {a.rounds} rounds, alone and beside, one BLAS thread per process", flush=True)
    decodes = f"decode steps (batch {a.batch}, {a.context}-token contexts)"
    for timed, beside, what, doing in (("decode", ("prefill",), decodes, "a prefilling process"),
                                       ("decode", ("memory",), decodes, "a memory-streaming process"),
                                       ("decode", ("python",), decodes, "a Python-looping process"),
                                       ("prefill", ("decode",), f"prompt steps ({a.context} tokens)", "a decoding process"),
                                       ("decode", ("prefill", "decode"), decodes, "a prefilling and a decoding process"),
                                       ("decode", ("decode", "decode"), decodes, "two decoding processes")):
        t = step_seconds(engine_dir, timed, a.context, a.batch, a.rounds, beside)
        alone, near = (np.percentile(t.wall[c], (50, 90)) for c in ("alone", "beside"))
        cpu_alone, cpu_near = (float(np.mean(t.cpu[c])) for c in ("alone", "beside"))
        print(f"  {what}, p50 / p90: alone {alone[0] * 1e3:.1f} / {alone[1] * 1e3:.1f} ms, beside {doing} "
              f"{near[0] * 1e3:.1f} / {near[1] * 1e3:.1f} ms: x{near[0] / alone[0]:.2f} / x{near[1] / alone[1]:.2f} "
              f"({len(t.wall['alone'])} / {len(t.wall['beside'])} steps); CPU per step {cpu_alone * 1e3:.1f} against "
              f"{cpu_near * 1e3:.1f} ms: x{cpu_near / cpu_alone:.2f}", flush=True)
    return 0
