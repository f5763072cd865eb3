"""The Python backend's empty /tmp/python_env_* directories of servers gone are removed, and only while no
tritonserver runs: a server whose directory is gone aborts at its shutdown (disagg.serve.leftovers)."""
from __future__ import annotations

import os
import time

from disagg.serve import leftovers


def test_only_empty_old_environment_directories_go_and_only_while_no_server_runs(tmp_path, monkeypatch):
    old = time.time() - 60
    for name in ("python_env_gone", "python_env_full", "python_env_new", "other_dir"):
        (tmp_path / name).mkdir()
    (tmp_path / "python_env_full" / "lib").write_text("an extracted environment")
    for name in ("python_env_gone", "python_env_full", "other_dir"):
        os.utime(tmp_path / name, (old, old))

    monkeypatch.setattr(leftovers, "servers_running", lambda: True)
    assert leftovers.sweep_python_envs(tmp_path) == []
    monkeypatch.setattr(leftovers, "servers_running", lambda: False)
    assert leftovers.sweep_python_envs(tmp_path) == ["python_env_gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_dir", "python_env_full", "python_env_new"]
