"""Replacing a file other processes read, so a reader sees the old bytes or the new ones, never half of them:
the bytes go to a temporary file of this writer's own beside it, which is then renamed over it (a rename
within one file system is atomic).

The temporary name is the writer's own, not derived from the target alone, because two writers may replace
one file at once: two servers started from one repository publish under the same instance names, and with a
shared temporary name one writer renamed it away under the other ("FileNotFoundError: ... .tmp -> ... .json",
a model instance that failed to load). Its suffix, ".tmp", matches no reader's pattern (*.json, *.npy, *.kv).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide a registry entry from an orchestrator run by another user
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
