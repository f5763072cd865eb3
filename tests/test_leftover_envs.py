"""What servers leave in /tmp is removed (disagg.serve.leftovers): the Python backend's empty python_env_*
directories of servers gone, only while no tritonserver runs (a server whose directory is gone aborts at its
shutdown), and the work directories of servers whose starter was killed, once no process names them."""
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


def test_a_work_directory_goes_once_old_and_named_by_no_running_process(tmp_path):
    old = time.time() - 120
    for name in ("disagg-tritonserver-gone", "disagg-tritonserver-serving", "disagg-tritonserver-new"):
        (tmp_path / name / "backends" / "python").mkdir(parents=True)
    for name in ("disagg-tritonserver-gone", "disagg-tritonserver-serving"):
        os.utime(tmp_path / name, (old, old))
    serving = f"tritonserver --backend-directory={tmp_path}/disagg-tritonserver-serving/backends --model-repository=m"
    assert leftovers.sweep_workdirs(tmp_path, in_use=serving) == ["disagg-tritonserver-gone"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disagg-tritonserver-new", "disagg-tritonserver-serving"]
    assert leftovers.sweep_workdirs(tmp_path) == ["disagg-tritonserver-serving"]  # no such process runs here
