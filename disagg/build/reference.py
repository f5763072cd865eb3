"""Reference-backend build: generate the checkpoint if asked, then shard it into one engine per role."""
from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from disagg.backend import EngineBackend
from disagg.build.manifest import Manifest, inputs_key
from disagg.checkpoint import generate_checkpoint, tokenizer_config
from disagg.engine.config import ENGINE_FORMAT, BuildConfig, EngineConfig, LlamaConfig, Mapping
from disagg.engine.weights import load_hf_weights, write_engine
from disagg.repository import Model, python_model, repo_relative, role_models
from disagg.spec import DeploymentSpec, RoleSpec

GENERATED_MARKER = ".disagg-generated.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    return [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]


def ensure_checkpoint(spec: DeploymentSpec, log=print) -> None:
    """Generates the spec's checkpoint when it is missing or was generated from another preset, seed or
    tokenizer_config.json (a newer generator's chat template, say)."""
    m = spec.model
    if m.generate_preset is None:
        return
    wanted = {"preset": m.generate_preset, "seed": m.generate_seed, "tokenizer_config": tokenizer_config()}
    marker = m.path / GENERATED_MARKER
    if (m.path / "config.json").is_file():
        if not marker.is_file():
            return  # a user's checkpoint: never overwritten
        if json.loads(marker.read_text()) == wanted:
            return
    log(f"generating checkpoint {m.path} (preset {m.generate_preset}, seed {m.generate_seed})")
    generate_checkpoint(m.path, m.generate_preset, m.generate_seed)
    marker.write_text(json.dumps(wanted))


def engine_config(spec: DeploymentSpec, role: RoleSpec) -> EngineConfig:
    return EngineConfig(
        role=role.name,
        model=LlamaConfig.from_dir(spec.model.path),
        mapping=Mapping(role.tp, role.pp),
        build=BuildConfig(
            max_batch_size=role.max_batch_size,
            max_input_len=role.max_input_len,
            max_seq_len=role.max_seq_len,
            max_num_tokens=role.max_num_tokens,
            tokens_per_block=role.tokens_per_block,
            kv_cache_blocks=role.kv_cache_blocks,
            enable_chunked_context=role.enable_chunked_context,
            enable_kv_cache_reuse=role.enable_kv_cache_reuse,
        ),
        dtype=spec.model.dtype,
    )


def _role_key(spec: DeploymentSpec, role: RoleSpec) -> str:
    params = {"format": ENGINE_FORMAT, "engine": json.loads(engine_config(spec, role).to_json())}
    return inputs_key(checkpoint_files(spec.model.path), params)


def dry_run_lines(spec: DeploymentSpec, roles: list[str]) -> list[str]:
    lines = []
    if spec.model.generate_preset:
        lines.append(f"# generate {spec.model.path} from preset {spec.model.generate_preset} seed {spec.model.generate_seed} if missing")
    for name in roles:
        r = spec.roles[name]
        lines.append(f"# shard {spec.model.path} -> {spec.engine_dir(name)} (tp={r.tp} pp={r.pp}, {r.world_size} rank files)")
    return lines


def build_roles(spec: DeploymentSpec, roles: list[str], force: bool, log=print) -> list[str]:
    """Builds the roles whose inputs changed (all of them with `force`); returns the names rebuilt.
    `build/manifest.json` records what each engine was built from."""
    manifest = Manifest(spec.build_dir / "manifest.json")
    ensure_checkpoint(spec, log)
    keys = {name: _role_key(spec, spec.roles[name]) for name in roles}
    todo = [n for n in roles if force or not manifest.up_to_date(f"engine:{n}", keys[n])]
    for name in roles:
        if name not in todo:
            log(f"[{name}] engine up to date ({spec.engine_dir(name)})")
    if not todo:
        return []
    weights = load_hf_weights(spec.model.path)
    total = sum(spec.roles[n].world_size for n in todo)
    with tqdm(total=total, desc="building engines", unit="rank", disable=None) as bar:
        for name in todo:
            role = spec.roles[name]
            bar.set_postfix_str(f"{name} tp={role.tp} pp={role.pp}")
            out = spec.engine_dir(name)
            for stale in out.glob("rank*.safetensors"):
                stale.unlink()
            files = write_engine(out, engine_config(spec, role), weights, progress=lambda _rank: bar.update())
            manifest.record(f"engine:{name}", keys[name], [*files, out / "config.json"])
    for name in todo:
        log(f"[{name}] engine built ({spec.engine_dir(name)}, tp={spec.roles[name].tp} pp={spec.roles[name].pp})")
    return todo


def weights_key(spec: DeploymentSpec) -> str:
    """Names the model's weights (the checkpoint's contents and the dtype): what KV blocks kept on disk
    were computed with."""
    return inputs_key(checkpoint_files(spec.model.path), {"dtype": spec.model.dtype})[:16]


def engine_models(spec: DeploymentSpec) -> list[Model]:
    """The reference engine's Python model per engine model name (disagg/triton/engine_model.py), with the
    tensorrtllm backend's tensor names. Its engine dir is relative to the repository, so the committed
    repository works from any checkout, unless `output.engine_root` names where the serving host has it."""
    kv = spec.kv_transfer
    models = []
    for role in spec.roles.values():
        engine = str(spec.engine_root / role.name) if spec.engine_root else repo_relative(spec, spec.engine_dir(role.name))
        instances = role.instances if role.name == "aggregated" else 1  # else a model per instance
        for name in role_models(spec, role.name):
            models.append(python_model(
                name, "engine.pbtxt.j2", "engine_model", role=role, instances=instances,
                parameters={
                    "engine_dir": engine,
                    "role": role.name,
                    "kv_transfer_backend": kv.backend,
                    "kv_lease_seconds": kv.lease_seconds,
                    "kv_bind_address": kv.bind_address,
                    "kv_store_bytes": role.kv_store_mb << 20,
                    "kv_store_disk_bytes": role.kv_store_disk_mb << 20,
                    "kv_store_disk_dir": repo_relative(spec, role.kv_store_disk_dir / weights_key(spec)) if role.kv_store_disk_mb else "",
                },
            ))
    return models


class ReferenceBackend(EngineBackend):
    """The CPU reference engine: sharded numpy engines, served by Python models."""

    def build_roles(self, spec, roles, force, log):
        return build_roles(spec, roles, force, log)

    def dry_run_lines(self, spec, roles):
        return dry_run_lines(spec, roles)

    def engine_models(self, spec):
        return engine_models(spec)
