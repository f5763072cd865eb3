"""`python -m disagg.k8s.prestop`: an engine pod's preStop hook. It lets the fronts stop sending requests,
then waits until the pod's engines hold none, before Kubernetes sends SIGTERM: mpirun, the container's
first process, passes SIGTERM to every rank at once, so a request still running then would be cut off.

    python -m disagg.k8s.prestop --metrics http://127.0.0.1:8002/metrics --after 10 --timeout 40
"""
from __future__ import annotations

import argparse
import time

from disagg.triton.replicas import scrape, wait_quiet

POLL_S = 0.2  # the backend refreshes its gauges every iteration or 100 ms


def wait_idle(metrics_url: str, after_s: float, timeout_s: float) -> int:
    """Sleeps `after_s`, then waits until no model reports active requests (or `timeout_s` more has
    passed); returns the active requests at the end."""
    time.sleep(after_s)
    try:
        return wait_quiet(lambda: sum(load.active for load in scrape(metrics_url).values()), timeout_s, POLL_S)
    except Exception:  # noqa: BLE001 - a server already going: nothing left to wait for
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.k8s.prestop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, help="the pod's Prometheus endpoint")
    p.add_argument("--after", type=float, required=True, help="seconds the fronts take to stop sending requests")
    p.add_argument("--timeout", type=float, required=True, help="most seconds to wait for the requests held")
    args = p.parse_args(argv)
    active = wait_idle(args.metrics, args.after, args.timeout)
    print(f"preStop: {active} requests still active" if active else "preStop: no request active", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
