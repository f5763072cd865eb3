"""The HTTP routes: OpenAI's completions, chat completions and models, over the served ensembles.

Each generation is validated here first with preprocessing's own checks (`Preprocessor.prepare`), so a
bad request gets a 400 naming the field and the limit before anything reaches the server, and its
prompt is counted exactly as the engines will see it. Then it is one gRPC stream to the model the client
named (`ensemble`: disaggregated; `aggregated`: the baseline). Streaming answers are server-sent events
(`data: {...}`, then `data: [DONE]`); with `stream_options.include_usage` a last chunk carries the usage.
A client that disconnects cancels the generation, streamed or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from disagg.openai.chat_template import TemplateError
from disagg.openai.deployment import Deployment
from disagg.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from disagg.openai.stop import StopMatcher
from disagg.openai.triton_stream import EngineError, TritonStreams
from disagg.serve.health import report
from disagg.serve.metrics import merge, scrape
from disagg.triton.preprocessing import InputError

_DISCONNECT_POLL_S = 0.1
MAX_BODY_BYTES = 4 << 20  # far above any prompt the engines accept; a larger body is refused unread


@dataclass
class Generation:
    """One validated request, ready to stream: what to send the ensemble and how to finish the answer."""

    model: str
    text: str
    options: dict
    prompt_tokens: int
    max_tokens: int
    stops: list[str]
    include_usage: bool
    continuous_usage: bool
    completion_tokens: int = 0
    finish_reason: str | None = None

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def _options(req: CompletionRequest | ChatCompletionRequest, prepared_max: int, vocab: int) -> dict:
    """OpenAI's sampling fields as the ensemble's inputs. temperature 0 is greedy (top_k 1); otherwise
    OpenAI's defaults (temperature 1, top_p 1: the whole vocabulary) unless the request narrows them, and
    without a seed a fresh one, since TensorRT-LLM's default seed (0) would give every unseeded request
    the same sample. `ignore_eos` is end_id -1, as TensorRT-LLM serves it."""
    if req.top_k is not None and req.top_k > vocab:
        raise APIError(f"top_k: {req.top_k} is over the vocabulary size {vocab}", param="top_k")
    greedy = req.temperature == 0.0 or req.top_k == 1
    options = {
        "max_tokens": prepared_max,
        "min_tokens": req.min_tokens or None,
        "end_id": -1 if req.ignore_eos else None,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "service_class": req.service_class.encode() if req.service_class else None,
    }
    if greedy:
        return options | {"top_k": 1}
    return options | {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": None if req.top_k in (None, -1) else req.top_k,
        "seed": secrets.randbits(63) if req.seed is None else req.seed,
    }


def _prepare(deployment: Deployment, req, text: str, max_tokens: int | None, prompt_field: str,
             limit_field: str = "max_tokens") -> Generation:
    """Checks `req` as preprocessing will, naming OpenAI's fields (`prompt_field`: where the text came from,
    `limit_field`: the field that gave `max_tokens`)."""
    req.check_unsupported()
    if req.model not in deployment.models:
        raise APIError(f"The model '{req.model}' does not exist (served: {', '.join(deployment.models)})",
                       status=404, param="model", kind="invalid_request_error")
    stops = req.stop_strings()
    if req.service_class and req.service_class not in deployment.service_classes:  # worded as the orchestrator's refusal
        known = ", ".join(deployment.service_classes) or "none: orchestrator.service_classes is not set"
        raise APIError(f"service_class: {req.service_class!r} is not a service class of this deployment ({known})", param="service_class")
    if max_tokens is None:
        max_tokens = deployment.default_max_tokens(deployment.prompt_tokens(text))
    try:
        prepared = deployment.pre.prepare(
            text.encode(), max_tokens, -1 if req.ignore_eos else None, min_tokens=req.min_tokens or None,
            **{k: v for k, v in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)) if v is not None},
        )
    except InputError as exc:
        sent_as = {"text_input": prompt_field, "max_tokens": limit_field}
        field = str(exc).split(":", 1)[0]
        named = sent_as.get(field, field)
        message = named + str(exc)[len(field):]
        for public, sent in sent_as.items():  # a limit the message names ("... is over max_tokens=N"), as it was sent
            message = message.replace(f"{public}=", f"{sent}=")
        raise APIError(message, param=named) from None
    options = _options(req, max_tokens, deployment.pre.tokenizer.get_vocab_size(with_added_tokens=True))
    stream_options = req.stream_options
    if stream_options is not None and not req.stream:
        raise APIError("stream_options: only allowed when stream is true", param="stream_options")
    return Generation(req.model, text, options, int(prepared.input_ids.size), max_tokens, stops,
                      bool(stream_options and stream_options.include_usage), bool(stream_options and stream_options.continuous_usage_stats))


async def _run(streams: TritonStreams, gen: Generation) -> AsyncIterator[str]:
    """The answer's text pieces as they come; sets gen.completion_tokens and gen.finish_reason."""
    matcher = StopMatcher(gen.stops)
    chunks = streams.generate(gen.model, gen.text, gen.options, request_id=uuid.uuid4().hex)
    try:
        async for chunk in chunks:
            gen.completion_tokens += chunk.tokens
            text, stopped = matcher.feed(chunk.text)
            if text:
                yield text
            if stopped:
                gen.finish_reason = "stop"
                return  # closing `chunks` cancels the rest of the generation
    except EngineError as exc:
        # "...: retry shortly" (no replica serving; no pool predicted to meet the service class) is a
        # refusal to retry, as OpenAI's 503 "overloaded"; anything else is the server's failure.
        raise APIError(str(exc), status=503 if str(exc).endswith("retry shortly") else 500) from None
    finally:
        await chunks.aclose()
    if rest := matcher.flush():
        yield rest
    gen.finish_reason = "length" if gen.completion_tokens >= gen.max_tokens else "stop"


async def _unless_disconnected(request: Request, work: Awaitable):
    """`work`'s result, or cancel it when the HTTP client goes away first (then the generation stops)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if not done and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError("the client disconnected", status=499)
    return task.result()


def _chunk_usage(gen: Generation) -> dict:
    """A streamed chunk's usage field: the count so far (continuous_usage_stats), null before the last
    chunk (include_usage), or absent."""
    if gen.continuous_usage:
        return {"usage": gen.usage()}
    return {"usage": None} if gen.include_usage else {}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers={"Retry-After": "1"} if exc.status == 503 else None)


def create_app(deployment: Deployment, grpc_url: str, metrics_urls: dict[str, str] | None = None) -> FastAPI:
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.streams = TritonStreams(grpc_url)
        yield
        await app.state.streams.close()

    app = FastAPI(title="disagg OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return _error_response(exc)

    async def body_of(request: Request, schema):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(f"the request body is {len(raw)} bytes, over the limit {MAX_BODY_BYTES}", status=413)
        try:
            body = json.loads(raw)
        except ValueError:
            raise APIError("We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise APIError("The request body must be a JSON object.")
        try:
            return schema.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "disagg"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in deployment.models]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name not in deployment.models:
            raise APIError(f"The model '{name}' does not exist", status=404, param="model")
        return model_card(name)

    @app.get("/ready")
    @app.get("/health")
    async def ready():
        """Readiness for a load balancer or Kubernetes probe: 503 while any engine role has no live instance."""
        body = report(deployment.board_key, list(deployment.engines), await app.state.streams.ready())
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics():
        """Every server's metrics in one exposition, labelled `server` (a server being restarted is left out)."""
        texts = {}
        for name, url in (metrics_urls or {}).items():
            try:
                texts[name] = await asyncio.to_thread(scrape, url, 2.0)
            except OSError:
                continue
        return PlainTextResponse(merge(texts), media_type="text/plain; version=0.0.4")

    @app.get("/live")
    async def live():
        """Liveness: the server answers (true while a dead engine is being reloaded)."""
        is_live = await app.state.streams.live()
        return JSONResponse({"live": is_live}, status_code=200 if is_live else 503)

    async def respond(request: Request, gen: Generation, stream: bool, chunk, whole):
        """`chunk(text, finish_reason, first)` -> one streamed event; `whole(text)` -> the non-streamed body."""
        streams = request.app.state.streams
        if not stream:
            async def collect() -> str:
                return "".join([piece async for piece in _run(streams, gen)])

            return JSONResponse(whole(await _unless_disconnected(request, collect())))

        # The first piece comes before the response starts: an error before any token (a refusal to
        # retry, a bad input the ensemble found) then gets its own status, as a non-streamed one does.
        pieces = _run(streams, gen)
        try:
            head = await _unless_disconnected(request, anext(pieces, None))
        except APIError as exc:
            return _error_response(exc)

        async def events():
            first = True
            try:
                if head is not None:
                    yield _sse(chunk(head, None, first))
                    first = False
                async for piece in pieces:
                    yield _sse(chunk(piece, None, first))
                    first = False
                yield _sse(chunk("", gen.finish_reason, first))
                if gen.include_usage:
                    yield _sse({**chunk("", None, False), "choices": [], "usage": gen.usage()})
            except APIError as exc:
                yield _sse(exc.body())
            finally:
                await pieces.aclose()  # a client gone mid-stream: the generation is cancelled now
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await body_of(request, CompletionRequest)
        prompt = req.prompt_text()
        gen = await asyncio.to_thread(_prepare, deployment, req, prompt, req.max_tokens, "prompt")  # tokenizing: off the loop
        ident, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = prompt if req.echo else ""

        def base(choices: list) -> dict:
            body = {"id": ident, "object": "text_completion", "created": now, "model": req.model, "choices": choices}
            return body | _chunk_usage(gen)

        def chunk(text: str, finish: str | None, first: bool) -> dict:
            return base([{"index": 0, "text": (echo if first else "") + text, "logprobs": None, "finish_reason": finish}])

        def whole(text: str) -> dict:
            body = base([{"index": 0, "text": echo + text, "logprobs": None, "finish_reason": gen.finish_reason}])
            return body | {"usage": gen.usage()}

        return await respond(request, gen, req.stream, chunk, whole)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await body_of(request, ChatCompletionRequest)
        try:
            text = deployment.chat_prompt([m.for_template() for m in req.messages], req.add_generation_prompt)
        except LookupError as exc:
            raise APIError(str(exc), param="messages") from None
        except TemplateError as exc:
            raise APIError(f"messages: {exc}", param="messages") from None
        limit_field, limit = req.token_limit()
        gen = await asyncio.to_thread(_prepare, deployment, req, text, limit, "messages", limit_field)
        ident, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def base(choices: list, kind: str) -> dict:
            body = {"id": ident, "object": kind, "created": now, "model": req.model, "choices": choices}
            return body | _chunk_usage(gen)

        def chunk(text: str, finish: str | None, first: bool) -> dict:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            return base([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], "chat.completion.chunk")

        def whole(text: str) -> dict:
            message = {"role": "assistant", "content": text}
            body = base([{"index": 0, "message": message, "logprobs": None, "finish_reason": gen.finish_reason}], "chat.completion")
            return body | {"usage": gen.usage()}

        return await respond(request, gen, req.stream, chunk, whole)

    return app
