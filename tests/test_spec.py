"""Deployment spec validation: every bad spec fails before any work, naming the key path and the reason."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from disagg.cli import main
from disagg.spec import SpecError, check_against_model, load_spec, model_config_for, parse_spec

BASE = yaml.safe_load(Path("configs/cpu-tiny.yaml").read_text())


def with_change(path: str, value) -> dict:
    """BASE with one dotted key set (value None deletes it)."""
    raw = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return raw


def check(raw: dict) -> None:
    spec = parse_spec(raw)
    check_against_model(spec, model_config_for(spec))


def test_default_spec_is_valid():
    spec = load_spec("configs/cpu-tiny.yaml")
    assert set(spec.roles) == {"prefill", "decode", "aggregated"}
    assert spec.roles["decode"].max_batch_size == 32 and spec.disaggregated


@pytest.mark.parametrize(
    "path, value, key, reason",
    [
        ("roles.decode.tp", 3, "roles.decode.tp", "3 does not divide num_key_value_heads=4"),
        ("roles.decode.tpp", 2, "roles.decode.tpp", "unknown key"),
        ("roles.prefill.max_input_len", 1000, "roles.prefill.max_input_len", "1000 must be below max_seq_len=320"),
        ("roles.prefill.max_seq_len", 4096, "roles.prefill.max_seq_len", "4096 exceeds the model's max_position_embeddings=512"),
        ("roles.prefill.pp", 8, "roles.prefill.pp", "8 is more pipeline stages than num_hidden_layers=4"),
        ("roles.decode.tokens_per_block", 12, "roles.decode.tokens_per_block", "12 is not a power of 2"),
        ("roles.decode.max_batch_size", "many", "roles.decode.max_batch_size", "'many' is not of type 'integer'"),
        ("roles.decode.max_batch_size", None, "roles.decode.max_batch_size", "required key is missing"),
        ("roles.prefill.kv_cache_blocks", 4, "roles.prefill.kv_cache_blocks", "cannot hold one sequence of max_seq_len=320 (needs 20)"),
        ("roles.decode", None, "roles.decode", "required: prefill and decode come as a pair"),
        ("backend", "vllm", "backend", "'vllm' is not one of ['reference', 'tensorrt_llm']"),
        ("kv_transfer.backend", "rdma", "kv_transfer.backend", "'rdma' is not one of"),
        ("model.dtype", "float16", "model.dtype", "the reference engine computes in float32 only"),
        ("model.generate.preset", "huge", "model.generate.preset", "unknown preset 'huge'"),
        ("roles.prefill.max_num_tokens", 100, "roles.prefill.max_num_tokens", "100 is below max_input_len=256"),
        ("roles.decode.max_input_len", 128, "roles.decode.max_input_len", "below roles.prefill.max_input_len=256"),
        ("roles.decode.devices", [[0], [1]], "roles.decode.devices", "2 device lists for instances=1"),
        ("roles.prefill.kv_store_mb", 64, "roles.prefill.kv_store_mb", "a prefix store needs enable_kv_cache_reuse: true on the role"),
        ("roles.prefill.kv_store_disk_mb", 64, "roles.prefill.kv_store_disk_mb", "a disk tier goes below the host-memory store: set kv_store_mb too"),
        ("orchestrator.coalesce_backlog", -1, "orchestrator.coalesce_backlog", "-1 is less than the minimum of 0"),
    ],
)
def test_bad_spec_names_key_and_reason(tmp_path, path, value, key, reason):
    raw = with_change(path, value)
    if path.startswith("model.generate"):
        raw["model"]["path"] = str(tmp_path / "absent")
    with pytest.raises(SpecError) as err:
        check(raw)
    assert err.value.path == key
    assert reason in str(err.value)
    assert str(err.value).startswith(f"{key}: ")


def test_devices_shared_between_roles_are_rejected():
    raw = with_change("roles.prefill.devices", [[0]])
    raw["roles"]["decode"]["devices"] = [[0]]
    with pytest.raises(SpecError, match=r"roles.decode.devices.0: GPU 0 on node 'localhost' is already used by roles.prefill"):
        check(raw)


def test_device_count_must_equal_tp_times_pp():
    raw = with_change("roles.prefill.devices", [[0, 1, 2]])
    raw["roles"]["prefill"]["tp"] = 2
    with pytest.raises(SpecError, match=r"roles.prefill.devices.0: 3 devices \[0, 1, 2\] but tp\*pp = 2\*1 = 2"):
        check(raw)


def test_cli_reports_spec_errors_before_any_work(tmp_path, capsys):
    raw = with_change("roles.decode.tp", 3)
    raw["output"] = {"build_dir": str(tmp_path / "build"), "model_repository": str(tmp_path / "repo")}
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(spec_file)]) == 2
    assert "error: roles.decode.tp: 3 does not divide num_key_value_heads=4" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()


def test_unreadable_yaml_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("roles: [unclosed")
    with pytest.raises(SpecError, match="is not valid YAML"):
        load_spec(bad)


def test_service_classes_are_checked_and_the_first_is_the_default():
    classes = {"interactive": {"ttft_ms": 500, "tpot_ms": 50}, "batch": {}}
    spec = parse_spec(with_change("orchestrator.service_classes", classes))
    assert spec.orchestrator.service_classes == (("interactive", 500, 50), ("batch", None, None))
    assert spec.orchestrator.default_service_class == "interactive"
    raw = with_change("orchestrator.service_classes", classes)
    raw["orchestrator"]["default_service_class"] = "gold"
    with pytest.raises(SpecError, match=r"^orchestrator.default_service_class: 'gold' is not one of orchestrator.service_classes \(interactive, batch\)$"):
        parse_spec(raw)
    with pytest.raises(SpecError, match=r"^orchestrator.service_classes.batch.tpot_ms: 0 is less than or equal to the minimum of 0$"):
        parse_spec(with_change("orchestrator.service_classes", {"batch": {"tpot_ms": 0}}))
    with pytest.raises(SpecError, match=r"^orchestrator.service_classes.batch.itl_ms: unknown key \(allowed here: tpot_ms, ttft_ms\)$"):
        parse_spec(with_change("orchestrator.service_classes", {"batch": {"itl_ms": 5}}))
    assert spec.orchestrator.pool_routing == "service_class"
    assert parse_spec(with_change("orchestrator.pool_routing", "round_robin")).orchestrator.pool_routing == "round_robin"
    with pytest.raises(SpecError, match=r"^orchestrator.pool_routing: 'fastest' is not one of \['service_class', 'least_loaded', 'round_robin'\]$"):
        parse_spec(with_change("orchestrator.pool_routing", "fastest"))
