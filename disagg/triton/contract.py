"""What the orchestrator exchanges with an engine model, in one place.

Both engine slots (the reference engine's Python model and the tensorrtllm backend) must declare these
tensors with the same name, type and shape, and both must be decoupled: tests/test_contract.py checks
the rendered configs of both backends against this list.
"""
# Request tensors forwarded unchanged from the orchestrator's own inputs.
FORWARDED_INPUTS = (
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "temperature", "runtime_top_k", "runtime_top_p",
    "seed", "min_tokens",
)
# Tensors the orchestrator sets itself: streaming (always on towards engines), the handoff, cancellation.
SET_INPUTS = ("streaming", "context_phase_params", "stop")
OUTPUTS_READ = ("output_ids", "context_phase_params")
REQUEST_PARAMETERS = ("request_type",)  # its values: disagg.engine.engine.REQUEST_TYPES
# (plus the reference engine's `disagg_internal_key`, disagg.triton.credential: the tensorrtllm backend has none)
# The tensorrtllm backend's answer to a context-only request that ended in its context phase (end_id first,
# or one output token): the executor gives it no context phase params, and model_instance_state.cc
# fillTritonResponse throws this, which its catch sends as the response's error.
CONTEXT_PARAMS_MISSING = "contextParams must be present in the response"
# The orchestrator calls the engine models over the engine server's own endpoints (not BLS: concurrent
# decoupled BLS streams crash Triton 2.51's python backend), `http://host:port` over HTTP, `host:port` over
# gRPC (disagg.triton.transport). disagg-serve sets this; default: the standard HTTP port.
# Engines served by another node's tritonserver (a separate pool) are named in the orchestrator's
# `engine_urls` parameter ("model=http://host:port,..."), at that server's standard port.
ENGINE_URL_ENV = "DISAGG_ENGINE_URL"
ENGINE_URLS_ENV = "DISAGG_ENGINE_URLS"  # "model=http://host:port,...": engines served elsewhere (disagg-serve's engine servers)
ENGINE_HTTP_PORT = 8000
ENGINE_GRPC_PORT = 8001
ENGINE_METRICS_PORT = 8002  # where a pool's replicas publish their load (disagg.triton.replicas)
DEFAULT_ENGINE_URL = f"http://127.0.0.1:{ENGINE_HTTP_PORT}"


def _pairs(value: str, parameter: str, form: str, valid) -> dict[str, str]:
    pairs = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, val = item.partition("=")
        if not sep or not key or not valid(val):
            raise ValueError(f"{parameter}: {item!r} is not {form}")
        pairs[key] = val
    return pairs


def parse_engine_urls(value: str) -> dict[str, str]:
    """"decode=http://decode-node:8000,decode_1=..." -> {model: url}; empty: every engine is on this server."""
    return _pairs(value, "engine_urls", "model=host:port", lambda url: ":" in url)


def parse_input_names(value: str) -> dict[str, str]:
    """The orchestrator's `engine_input_names`, "seed=random_seed,...": inputs the engine's release reads
    under an older name (disagg.trtllm.versions); empty: the newest names."""
    return _pairs(value, "engine_input_names", "name=engine_name", bool)


def rename_inputs(arrays: dict, names: dict[str, str]) -> dict:
    """The orchestrator's request tensors under the names the engine's release reads (`parse_input_names`)."""
    return {names.get(name, name): array for name, array in arrays.items()}
