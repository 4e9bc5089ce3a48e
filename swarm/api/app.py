"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions`` with server-sent-event streaming, plus ``/metrics`` (Prometheus) and ``/health``.

Each generation runs on a worker thread (``swarm.api.engine``) and hands its text to the request's coroutine through
a queue. A caller that goes away cancels its generation: a stream's coroutine is cancelled by Starlette when the
connection drops, a plain request's by a watcher polling for the disconnect; either way the worker stops before its
next token and closes the session, which frees the servers' caches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from swarm.api import errors
from swarm.api.embeddings import embed
from swarm.api.engine import Outcome
from swarm.api.errors import ApiError
from swarm.api.limits import caller_of, read_body
from swarm.api.replies import (
    ChatCompletion,
    EmbeddingList,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RouteHop,
    TextCompletion,
    Usage,
    new_id,
    now,
)
from swarm.api.respond import Collected, chat_choice, prepare, text_choice
from swarm.api.runs import ApiState, Run, RunStream, watch_disconnect
from swarm.api.schema import ChatRequest, CompletionRequest, EmbeddingRequest
from swarm.api.sse import Chunks

log = logging.getLogger(__name__)
Parsed = TypeVar("Parsed", ChatRequest, CompletionRequest, EmbeddingRequest)


def _parse(body: bytes, cls: type[Parsed]) -> Parsed:
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise errors.bad_request(f"{where}: {first['msg']}" if where else first["msg"], param=where) from None
    if not isinstance(req, EmbeddingRequest) and (bad := req.unsupported()) is not None:
        raise errors.bad_request(f"{bad} is not supported by this server", param=bad)
    return req


def _route(outcome: Outcome) -> list[RouteHop]:
    return [
        RouteHop(peer_id=h.peer_id, start=h.start, end=h.end, dtype=h.dtype, quantization=h.quantization)
        for h in outcome.route
    ]


def _usage(o: Outcome) -> Usage:
    return Usage(
        prompt_tokens=o.prompt_tokens,
        completion_tokens=o.completion_tokens,
        total_tokens=o.prompt_tokens + o.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=o.cached_tokens),
    )


def _error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def create_app(
    state: ApiState, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None
) -> FastAPI:
    app = FastAPI(title="swarm: OpenAI-compatible API", version="1", lifespan=lifespan)
    app.state.api = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = {401: "unauthorized", 404: "not_found", 503: "unavailable"}.get(e.status_code, "bad_request")
        headers = {"WWW-Authenticate": 'Bearer realm="swarm"'} if e.status_code == 401 else None
        response = _error_response(ApiError(e.status_code, str(e.detail), code=kind, outcome=kind))
        response.headers.update(headers or {})
        return response

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "models": {n: not s.missing() for n, s in state.models.items()}}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        with _counted(state, "models"):
            state.key_of(request)
            covered = [n for n, s in state.models.items() if not await asyncio.to_thread(s.missing)]
            return ModelList(data=[ModelCard(id=n, created=state.started) for n in covered])

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> ModelCard:
        with _counted(state, "models"):
            state.key_of(request)
            served = state.served(name)
            if await asyncio.to_thread(served.missing):
                raise errors.unknown_model(name, [])
            return ModelCard(id=served.name, created=state.started)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await _complete(state, request, "chat")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await _complete(state, request, "completions")

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(request: Request) -> Response:
        return await _embeddings(state, request)

    return app


async def _complete(state: ApiState, request: Request, endpoint: str) -> Response:
    t0 = time.monotonic()
    try:
        key = state.key_of(request)
        body = await read_body(request, state.limits.max_body_bytes, state.body_timeout)
        req: ChatRequest | CompletionRequest = (
            _parse(body, ChatRequest) if endpoint == "chat" else _parse(body, CompletionRequest)
        )
        served = state.served(req.model)
        caller = caller_of(request, key)
        # the slot is held from here: a chat template and a grammar (a schema compiled) cost CPU, counted per caller
        state.enter(caller)
        try:
            prepared = await asyncio.to_thread(prepare, req, served, state.limits)
            prompt, sampling = prepared.prompt, prepared.sampling
            gaps = await asyncio.to_thread(served.missing)
            if gaps:
                shown = ", ".join(f"{a}:{b}" for a, b in gaps)
                raise errors.unavailable(f"no server holds blocks {shown} of {served.name} now: retry later")
        except BaseException:
            state.leave(caller)
            raise
    except ApiError as e:
        state.metrics.observe(endpoint, e.outcome, time.monotonic() - t0)
        return _error_response(e)
    log.info(
        "%s request: %d prompt tokens, up to %d x %d new",
        endpoint,
        len(prompt),
        sampling.n,
        sampling.max_tokens,
        extra={"session": caller},
    )
    run = Run(state, served, prompt, sampling, caller)
    offset = 0 if sampling.echo is not None else len(prepared.prompt_text)
    if req.stream:
        return RunStream(
            run,
            _stream(state, run, req, Chunks(endpoint == "chat", served, sampling.logprobs is not None, offset), t0),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watcher = asyncio.create_task(watch_disconnect(request, run))
    try:
        got = [Collected() for _ in range(sampling.n)]
        async for piece in run.pieces():
            got[piece.index].add(piece)
        outcome = run.outcome()
        _record(state, endpoint, "ok", t0, outcome)
    except ApiError as e:
        _record(state, endpoint, e.outcome, t0, None)
        return _error_response(e)
    finally:
        run.cancel.set()
        watcher.cancel()
    rid, created, usage = new_id("chatcmpl" if endpoint == "chat" else "cmpl"), now(), _usage(outcome)
    logprobs = sampling.logprobs is not None
    if endpoint == "chat":
        chat_choices = [chat_choice(i, c, served, logprobs) for i, c in enumerate(got)]
        reply: ChatCompletion | TextCompletion = ChatCompletion(
            id=rid, created=created, model=served.name, choices=chat_choices, usage=usage, route=_route(outcome)
        )
    else:
        offset = 0 if sampling.echo is not None else len(prepared.prompt_text)
        text_choices = [text_choice(i, c, served, logprobs, offset) for i, c in enumerate(got)]
        reply = TextCompletion(
            id=rid, created=created, model=served.name, choices=text_choices, usage=usage, route=_route(outcome)
        )
    return JSONResponse(reply.model_dump(mode="json"))


async def _embeddings(state: ApiState, request: Request) -> Response:
    """Embeddings take a generation slot of their caller's while they run (their inputs go through the swarm)."""
    t0 = time.monotonic()
    try:
        key = state.key_of(request)
        body = await read_body(request, state.limits.max_body_bytes, state.body_timeout)
        req = _parse(body, EmbeddingRequest)
        served = state.served(req.model)
        caller = caller_of(request, key)
        state.enter(caller)
        try:
            deadline = time.monotonic() + state.limits.request_timeout
            loop = asyncio.get_running_loop()
            reply: EmbeddingList = await loop.run_in_executor(state.pool, embed, served, req, deadline)
        except ApiError:
            raise
        except Exception as e:
            raise errors.from_swarm(e) from None
        finally:
            state.leave(caller)
    except ApiError as e:
        state.metrics.observe("embeddings", e.outcome, time.monotonic() - t0)
        return _error_response(e)
    state.metrics.observe("embeddings", "ok", time.monotonic() - t0)
    return JSONResponse(reply.model_dump(mode="json"))


async def _stream(
    state: ApiState, run: Run, req: ChatRequest | CompletionRequest, chunks: Chunks, t0: float
) -> AsyncIterator[str]:
    endpoint = "chat" if chunks.chat else "completions"
    label = "client_closed"  # unless the stream reaches its end or an error
    try:
        if chunks.chat:
            for i in range(req.n):
                yield chunks.opening(i)
        async for piece in run.pieces():
            yield chunks.piece(piece, _route(run.progress) if piece.finish else None)
        try:
            outcome = run.outcome()
        except ApiError as e:
            label = e.outcome
            yield e.event()  # the stream has begun and its status is sent: the error travels as an event
            return
        if req.include_usage():
            yield chunks.usage(_usage(outcome))
        yield "data: [DONE]\n\n"
        label = "ok"
        _record(state, endpoint, "ok", t0, outcome)
    finally:
        run.cancel.set()  # a dropped connection lands here (Starlette cancels the coroutine): stop the worker
        if label != "ok":
            state.metrics.observe(endpoint, label, time.monotonic() - t0)


@contextlib.contextmanager
def _counted(state: ApiState, endpoint: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    except ApiError as e:
        state.metrics.observe(endpoint, e.outcome, time.monotonic() - t0)
        raise
    state.metrics.observe(endpoint, "ok", time.monotonic() - t0)


def _record(state: ApiState, endpoint: str, outcome: str, t0: float, result: Outcome | None) -> None:
    state.metrics.observe(endpoint, outcome, time.monotonic() - t0)
    if result is not None:
        state.metrics.tokens(endpoint, result.completion_tokens, result.prompt_tokens)
        if result.first_token_s is not None:
            state.metrics.first_token(endpoint, result.first_token_s)
