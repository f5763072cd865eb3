"""`build-engines` on the reference backend: per-role engine dirs, and incremental rebuilds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.numpy import load_file

from disagg.cli import main

BASE = yaml.safe_load(Path("configs/cpu-tiny.yaml").read_text())


def write_spec(tmp_path: Path, **role_changes) -> Path:
    raw = json.loads(json.dumps(BASE))
    raw["model"]["path"] = str(tmp_path / "ckpt")
    raw["output"] = {"build_dir": str(tmp_path / "build"), "model_repository": str(tmp_path / "repo")}
    for role, changes in role_changes.items():
        raw["roles"][role].update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def build(spec: Path, capsys, *extra: str) -> str:
    assert main(["--config", str(spec), "--no-render", *extra]) == 0
    return capsys.readouterr().out


def test_engine_dirs_are_written_like_tensorrt_llm(tmp_path, capsys):
    spec = write_spec(tmp_path, prefill={"tp": 2, "pp": 2})
    build(spec, capsys)
    prefill = tmp_path / "build/engines/prefill"
    assert sorted(p.name for p in prefill.iterdir()) == ["config.json", *[f"rank{r}.safetensors" for r in range(4)]]
    cfg = json.loads((prefill / "config.json").read_text())
    assert cfg["pretrained_config"]["mapping"] == {"tp_size": 2, "pp_size": 2, "world_size": 4}
    assert cfg["build_config"]["max_input_len"] == 256 and cfg["build_config"]["max_batch_size"] == 4
    rank3 = load_file(str(prefill / "rank3.safetensors"))  # tp_rank 1 of the last stage: layers 2-3
    assert rank3["model.layers.2.self_attn.q_proj.weight"].shape == (32, 64)  # 4 of 8 heads x 8
    assert rank3["model.layers.3.self_attn.k_proj.weight"].shape == (16, 64)  # 2 of 4 KV heads
    assert rank3["model.layers.2.mlp.down_proj.weight"].shape == (64, 64)  # half of 128 columns
    assert "model.layers.0.input_layernorm.weight" not in rank3 and "lm_head.weight" in rank3
    assert "model.embed_tokens.weight" in load_file(str(prefill / "rank0.safetensors"))


def test_second_run_does_no_work_and_changes_rebuild_only_dependents(tmp_path, capsys):
    spec = write_spec(tmp_path)
    out = build(spec, capsys)
    assert "generating checkpoint" in out and out.count("engine built") == 3
    manifest = json.loads((tmp_path / "build/manifest.json").read_text())
    assert set(manifest["steps"]) == {"engine:prefill", "engine:decode", "engine:aggregated"}
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "build/engines").rglob("*")}

    out = build(spec, capsys)
    assert "nothing to rebuild: every engine is up to date" in out and "engine built" not in out
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "build/engines").rglob("*")} == mtimes

    spec = write_spec(tmp_path, decode={"max_batch_size": 48})
    out = build(spec, capsys)
    assert "[decode] engine built" in out and "[prefill] engine up to date" in out and "[aggregated] engine up to date" in out
    assert json.loads((tmp_path / "build/engines/decode/config.json").read_text())["build_config"]["max_batch_size"] == 48

    out = build(spec, capsys, "--only", "prefill", "--force")
    assert "[prefill] engine built" in out and "decode" not in out


def test_changed_checkpoint_rebuilds_every_role(tmp_path, capsys):
    spec = write_spec(tmp_path)
    build(spec, capsys)
    cfg_path = tmp_path / "ckpt/config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rms_norm_eps"] = 1e-6
    cfg_path.write_text(json.dumps(cfg))
    out = build(spec, capsys)
    assert out.count("engine built") == 3


def test_tampered_engine_file_is_rebuilt(tmp_path, capsys):
    spec = write_spec(tmp_path)
    build(spec, capsys)
    (tmp_path / "build/engines/decode/rank0.safetensors").write_bytes(b"garbage")
    out = build(spec, capsys)
    assert "[decode] engine built" in out and "[prefill] engine up to date" in out


def test_dry_run_prints_steps_and_builds_nothing(tmp_path, capsys):
    spec = write_spec(tmp_path, decode={"tp": 2})
    assert main(["--config", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"-> {tmp_path}/build/engines/decode (tp=2 pp=1, 2 rank files)" in out
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize("only", ["prefill", "decode"])
def test_only_builds_one_role(tmp_path, capsys, only):
    spec = write_spec(tmp_path)
    out = build(spec, capsys, "--only", only)
    assert out.count("engine built") == 1 and f"[{only}] engine built" in out
