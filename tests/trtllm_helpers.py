"""The GPU example specs, pointed at a Llama-3.1-8B-shaped config.json so spec checks run without weights."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml

from disagg.spec import DeploymentSpec, check_against_model, parse_spec

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGY = ROOT / "tests" / "fixtures" / "topology"

LLAMA_3_1_8B_CONFIG = ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct.json"
LLAMA_3_1_8B = json.loads(LLAMA_3_1_8B_CONFIG.read_text())
LLAMA_3_1_8B_PARAMS = 8_030_261_248  # the published size of Llama-3.1-8B


def model_dir(tmp_path: Path, config: dict = LLAMA_3_1_8B) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def example_spec(name: str, model: Path, edit: Callable[[dict], None] | None = None) -> DeploymentSpec:
    """configs/<name>.yaml with model.path = `model`, after `edit(raw)`, through both spec passes."""
    source = ROOT / "configs" / f"{name}.yaml"
    raw = yaml.safe_load(source.read_text())
    raw["model"]["path"] = str(model)
    if edit is not None:
        edit(raw)
    spec = parse_spec(raw, source=source)
    check_against_model(spec, json.loads((model / "config.json").read_text()))
    return spec
