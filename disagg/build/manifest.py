"""Build manifest: content hashes of each step's inputs and outputs, so an unchanged step is skipped.

A step is up to date when the hash of its inputs (files + parameters) equals the recorded one and
every recorded output still has its recorded hash. `build/manifest.json` holds one entry per step.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inputs_key(files: list[Path], params: dict) -> str:
    """One hash over the named files' contents and a JSON-serialisable parameter dict."""
    h = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()


class Manifest:
    def __init__(self, path: Path):
        self.path = path
        self.steps: dict[str, dict] = json.loads(path.read_text())["steps"] if path.is_file() else {}

    def up_to_date(self, step: str, key: str) -> bool:
        entry = self.steps.get(step)
        if entry is None or entry["inputs"] != key:
            return False
        return all(Path(f).is_file() and file_sha256(Path(f)) == h for f, h in entry["outputs"].items())

    def record(self, step: str, key: str, outputs: list[Path]) -> None:
        self.steps[step] = {"inputs": key, "outputs": {str(f): file_sha256(f) for f in sorted(outputs)}}
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"version": 1, "steps": self.steps}, indent=2, sort_keys=True))
