"""Renders the Triton model repository of a deployment from the jinja2 templates in templates/.

The default deployment's repository is committed (model_repository/) and a test re-renders and diffs it,
so the output is deterministic and machine-independent: parameters hold paths relative to the repository
directory (`../build/engines/prefill`), which disagg.triton.paths resolves when a model loads. Every
config.pbtxt is parsed into Triton's own ModelConfig protobuf before anything is written.

The front (pre/postprocessing, orchestrators, ensembles) is the same for every engine backend; the engine
models and any files beside the repository come from the spec's backend (disagg.backend).
Models:
    preprocessing -> disagg_orchestrator -> postprocessing       = ensemble    (prefill + decode)
    preprocessing -> aggregated_orchestrator -> postprocessing   = aggregated  (aggregated_engine)
    tensorrt_llm_bls (orchestrator.bls): the first of them as one model, text in and text out
"""
from __future__ import annotations

import json
from pathlib import Path

from disagg.backend import backend_for
from disagg.repository import ENGINE_MODELS, Model, parse_config, python_model, render_template, repo_relative, role_models, write_changed
from disagg.spec import ROLES, DeploymentSpec
from disagg.triton.contract import ENGINE_HTTP_PORT, ENGINE_METRICS_PORT


def _text_parameters(spec: DeploymentSpec) -> tuple[dict, dict]:
    """The parameters of preprocessing and of postprocessing (tensorrt_llm_bls takes both). Their limits hold
    for every path behind them: prompts are checked against each role that reads prompts, output lengths
    against each role that generates."""
    prompt_roles = [r for name, r in spec.roles.items() if name != "decode"]
    output_roles = [r for name, r in spec.roles.items() if name != "prefill"]
    tokenizer_dir = repo_relative(spec, spec.model.path)
    return {
        "tokenizer_dir": tokenizer_dir,
        "max_input_len": min(r.max_input_len for r in prompt_roles),
        "max_output_len": min(r.max_output_len for r in output_roles),
        "max_seq_len": min(r.max_seq_len for r in output_roles),
        "add_special_tokens": "true" if spec.model.add_special_tokens else "false",
    }, {"tokenizer_dir": tokenizer_dir, "skip_special_tokens": "true"}


def _front_models(spec: DeploymentSpec) -> list[Model]:
    """preprocessing and postprocessing."""
    pre, post = _text_parameters(spec)
    batch = max(r.max_batch_size for r in spec.roles.values())
    return [
        python_model("preprocessing", "preprocessing.pbtxt.j2", "preprocessing", max_batch_size=batch, parameters=pre),
        python_model("postprocessing", "postprocessing.pbtxt.j2", "postprocessing", max_batch_size=batch, parameters=post),
    ]


def engine_urls(spec: DeploymentSpec) -> str:
    """The orchestrator's `engine_urls`: engine models that another node's server serves. The front end
    runs with the first role's node (see disagg.trtllm.render), every other node serving at its standard
    port. With pools the front runs apart from all of them, and each pool is a set of replicas behind a
    name (its headless Service) that the orchestrator resolves again and again (disagg.triton.replicas);
    a role in several pools is served by each, at its cost."""
    roles = [spec.roles[name] for name in ROLES if name in spec.roles]
    if spec.pools:
        def sources(role: str) -> str:
            pools = spec.pools_of(role)
            return "|".join(f"dns:{p.name}:{ENGINE_HTTP_PORT}:{ENGINE_METRICS_PORT}" + (f";cost={p.cost:g}" if len(pools) > 1 else "")
                            for p in pools)

        return ",".join(f"{name}={sources(role.name)}" for role in roles for name in role_models(spec, role.name))
    front = roles[0].node
    remote = []
    for role in roles:
        if role.node != front:
            remote += [f"{name}=http://{role.node}:{ENGINE_HTTP_PORT}" for name in role_models(spec, role.name)]
    return ",".join(remote)


def _entry_models(spec: DeploymentSpec) -> list[Model]:
    """Orchestrator + ensemble per path; the baseline goes through exactly the same front."""
    o = spec.orchestrator
    batch = max(r.max_batch_size for r in spec.roles.values())
    common = {
        "prefill_timeout_s": o.prefill_timeout_s,
        "decode_timeout_s": o.decode_timeout_s,
        "prefill_routing": o.prefill_routing,
        "coalesce_backlog": o.coalesce_backlog,
        "max_in_flight": o.max_in_flight,
        "service_classes": json.dumps({name: {"ttft_ms": ttft, "tpot_ms": tpot} for name, ttft, tpot in o.service_classes}),
        "default_service_class": o.default_service_class,
        "pool_routing": o.pool_routing,
        "engine_urls": engine_urls(spec),
        # inputs the engines' release reads under older names ("seed=random_seed" on TensorRT-LLM 0.17/0.18)
        "engine_input_names": ",".join(f"{new}={old}" for new, old in backend_for(spec).engine_input_names(spec).items()),
    }
    paths = []
    if spec.disaggregated:
        paths.append(("ensemble", "disagg_orchestrator", {
            "mode": "disaggregated", "context_model_name": ",".join(role_models(spec, "prefill")),
            "generation_model_name": ",".join(role_models(spec, "decode")),
        }))
    if "aggregated" in spec.roles:
        paths.append(("aggregated", "aggregated_orchestrator", {
            "mode": "aggregated", "aggregated_model_name": ENGINE_MODELS["aggregated"],
        }))
    models = []
    for ensemble, orchestrator, params in paths:
        models.append(python_model(
            orchestrator, "orchestrator.pbtxt.j2", "orchestrator", max_batch_size=batch,
            instances=o.instances, parameters={**params, **common},
        ))
        models.append(Model(ensemble, render_template(
            "ensemble.pbtxt.j2", name=ensemble, orchestrator=orchestrator, max_batch_size=batch,
        )))
    if o.bls:  # the first path: disaggregated where the spec has it
        pre, post = _text_parameters(spec)
        models.append(python_model(
            "tensorrt_llm_bls", "bls.pbtxt.j2", "bls", max_batch_size=batch,
            instances=o.instances, parameters={**paths[0][2], **common, **pre, **post},
        ))
    return models


def plan_models(spec: DeploymentSpec) -> list[Model]:
    """Every model of the spec's repository, rendered and checked, nothing written."""
    models = _front_models(spec) + backend_for(spec).engine_models(spec) + _entry_models(spec)
    for model in models:
        parse_config(model.name, model.config)
    return models


def repository_files(spec: DeploymentSpec, out_dir: Path) -> dict[Path, str]:
    """Path -> text of every file of the repository rendered into `out_dir`, and of the backend's files
    beside it (under `out_dir`'s parent)."""
    files: dict[Path, str] = {}
    models = plan_models(spec)
    for model in models:
        files[out_dir / model.name / "config.pbtxt"] = model.config
        if model.module is None:
            files[out_dir / model.name / "1" / ".gitkeep"] = ""  # Triton needs the version directory
        else:
            shim = render_template("model.py.j2", name=model.name, module=model.module)
            files[out_dir / model.name / "1" / "model.py"] = shim
    for path, text in backend_for(spec).extra_files(spec, [m.name for m in models]).items():
        files[out_dir.parent / path] = text
    return files


def render_repository(spec: DeploymentSpec, out_dir: str | Path) -> list[Path]:
    """Renders the spec's model repository into `out_dir`.

    Paths inside are relative to `spec.model_repository` (where the repository is served from), whatever
    `out_dir` is, so a render into a scratch directory diffs clean against the committed one. A
    `tensorrt_llm` spec also gets its MPI launch files in `<out_dir>/../launch/`. Files are written only
    when their content changes; returns the paths written (empty: already up to date). Nothing is deleted.
    """
    return write_changed(repository_files(spec, Path(out_dir)))
