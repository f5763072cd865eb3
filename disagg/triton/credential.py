"""The internal credential: only the deployment's own orchestrators drive its engine models.

The engine models are served on the same ports as the ensembles, and a client that sent `context_only`
to `prefill` and never claimed the handoff would hold KV blocks for a lease each: a cheap way to exhaust
the pool. So every engine call carries the request parameter `disagg_internal_key`, and an engine model
refuses a request without the right one before doing anything.

The key is `$DISAGG_INTERNAL_KEY` when set (the same secret on every server of a multi-server deployment),
else one random key per server run, created by the first model that asks in a file only the server's
user can read (`disagg-internal-<board key>` beside the load board). Tests and benchmarks that call engine
models directly read it the same way (`internal_key`).
"""
from __future__ import annotations

import hmac
import os
import secrets
import time

from disagg.triton.load_board import board_dir

INTERNAL_KEY_ENV = "DISAGG_INTERNAL_KEY"
PARAMETER = "disagg_internal_key"


def internal_key(board_key: str) -> str:
    """The deployment's key: the environment's, else the server run's (created here if nobody has yet)."""
    if os.environ.get(INTERNAL_KEY_ENV):
        return os.environ[INTERNAL_KEY_ENV]
    path = board_dir() / f"disagg-internal-{board_key}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        for _ in range(100):  # its creator may not have written it yet
            key = path.read_text()
            if key:
                return key
            time.sleep(0.01)
        raise RuntimeError(f"{path} stays empty: remove it and restart the server") from None
    key = secrets.token_hex(16)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key


def presented(parameters: dict, key: str) -> bool:
    """Whether a request's parameters carry `key`."""
    offered = parameters.get(PARAMETER)
    return isinstance(offered, str) and hmac.compare_digest(offered, key)
