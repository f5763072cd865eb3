"""What the orchestrator exchanges with an engine model, in one place.

Both engine slots (the reference engine's Python model and the tensorrtllm backend) must declare these
tensors with the same name, type and shape, and both must be decoupled: tests/test_contract.py checks
the rendered configs of both backends against this list.
"""
# Request tensors forwarded unchanged from the orchestrator's own inputs.
FORWARDED_INPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "temperature", "runtime_top_k", "runtime_top_p", "seed")
# Tensors the orchestrator sets itself: streaming (always on towards engines), the handoff, cancellation.
SET_INPUTS = ("streaming", "context_phase_params", "stop")
OUTPUTS_READ = ("output_ids", "context_phase_params")
REQUEST_PARAMETERS = ("request_type",)
REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")
# The orchestrator calls the engine models over Triton's gRPC endpoint (not BLS: concurrent decoupled
# BLS streams crash Triton 2.51's python backend). disagg-serve sets this; default: the standard port.
# Engines served by another node's tritonserver (a separate pool) are named in the orchestrator's
# `engine_urls` parameter ("model=host:port,..."), at that server's standard port.
ENGINE_URL_ENV = "DISAGG_ENGINE_GRPC_URL"
ENGINE_GRPC_PORT = 8001
DEFAULT_ENGINE_URL = f"127.0.0.1:{ENGINE_GRPC_PORT}"


def parse_engine_urls(value: str) -> dict[str, str]:
    """"decode=decode-pool:8001,decode_1=..." -> {model: url}; empty: every engine is on this server."""
    urls = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        model, sep, url = item.partition("=")
        if not sep or not model or ":" not in url:
            raise ValueError(f"engine_urls: {item!r} is not model=host:port")
        urls[model] = url
    return urls
