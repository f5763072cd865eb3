"""The request bodies the API accepts, and its errors in OpenAI's format.

Fields are OpenAI's, plus three that vLLM and benchmark clients (genai-perf, AIPerf `--extra-inputs`) send
for fixed output lengths and TensorRT-LLM sampling: `ignore_eos`, `min_tokens`, `top_k`, and this
deployment's `service_class` (one of the spec's orchestrator.service_classes; the openai client sends it
with `extra_body`). A field OpenAI
defines but this deployment cannot honour is refused by name unless it has the value that changes nothing
(`n: 1`, `logprobs: false`, ...); an unknown field is refused as OpenAI refuses it. Penalties go to the
ensemble, which refuses the ones its engines cannot apply, naming them.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.kind = kind or ("invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's first complaint, worded as OpenAI words its own, naming the field."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"] if part != "body")
    if first["type"] == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {field}", param=field)
    if first["type"] == "missing":
        return APIError(f"Missing required parameter: '{field}'", param=field)
    return APIError(f"{field}: {first['msg']} (got {first.get('input')!r})", param=field)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (AIPerf --per-chunk-usage)


class _Sampling(BaseModel):
    """What both endpoints share. Defaults are OpenAI's: sampling at temperature 1 over the whole vocabulary."""

    model_config = ConfigDict(extra="forbid")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: Literal[1] = 1
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM / TensorRT-LLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    top_k: int | None = Field(None, ge=-1)
    # disagg's: the request's class of service (disagg.triton.sla)
    service_class: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(f"stop: {len(stops)} sequences, at most 4", param="stop")
        if any(not s for s in stops):
            raise APIError("stop: a stop sequence must not be empty", param="stop")
        return stops

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this deployment", param="logit_bias")


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: Literal[1] | None = None
    suffix: str | None = None

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(f"prompt: {len(self.prompt)} prompts in one request, only 1 is supported", param="prompt")
            return self.prompt[0]
        return self.prompt

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None:
            raise APIError("logprobs is not supported by this deployment", param="logprobs")
        if self.suffix:
            raise APIError("suffix is not supported by this deployment", param="suffix")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the chat template as they are
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    add_generation_prompt: bool = True  # vLLM's extension: the template's assistant header after the messages

    def token_limit(self) -> tuple[str, int | None]:
        """The field that sets the answer's length and its value: max_completion_tokens, else the deprecated
        max_tokens, else None (as many as the engine allows)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs or self.top_logprobs:
            raise APIError("logprobs is not supported by this deployment", param="logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError("tools are not supported by this deployment", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(
                f"response_format: {self.response_format.get('type')!r} is not supported by this deployment (only 'text')",
                param="response_format",
            )
