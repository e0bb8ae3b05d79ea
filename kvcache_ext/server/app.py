"""The HTTP app: OpenAI's completions and chat completions (streamed as server-sent events or not),
the model list, health and metrics, on one :class:`~kvcache_ext.server.engine_thread.EngineThread`.

Handlers never touch the Engine: they turn a request into jobs (one per choice, ``n``), submit them,
and read the jobs' events back from an asyncio queue. Text is made here, per choice, by the
tokenizer's incremental detokenizer; a stop string it sees ends the choice and cancels its job, as
does a client that leaves (the engine frees the blocks at its next step).

Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: a request the
validation or the engine refuses is a 400 (an unknown model a 404, as OpenAI answers), a full queue a
503 with ``Retry-After``, a step that raised a 500 for its requests only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import Engine
from ..paged import PagedKVCache
from . import protocol
from .engine_thread import Accepted, EngineThread, Failed, Finished, Job, QueueFullError, Token
from .metrics import ServerMetrics

RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.25


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else None

    def body(self) -> protocol.ErrorResponse:
        detail = protocol.ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return protocol.ErrorResponse(error=detail)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error", 503: "server_error"}


def _failed_error(failure: Failed, param: str | None) -> APIError:
    """The error of a job the engine refused (400: ``param`` is at fault) or that failed (500, 503)."""
    error_type = _ERROR_TYPES.get(failure.status, "server_error")
    return APIError(failure.status, failure.message, error_type, param if failure.status == 400 else None)


def _location(problem: dict) -> tuple[str, ...]:
    """Where a pydantic problem lies in the body: field names and list indices. The members of a union
    are named by their types (``list[int]``, ``function-after[...]``), which no field name has."""
    return tuple(str(part) for part in problem.get("loc", ()) if part != "body" and "[" not in str(part))


def _validation_error(error: RequestValidationError, content_type: str | None) -> APIError:
    """The first field pydantic refused, saying where, what was expected and what came. A value no
    member of a union took has a problem per member: those at the deepest place in the value say what
    was expected there, together."""
    problems = error.errors()
    first = problems[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not _location(first) and isinstance(first.get("input"), bytes):  # FastAPI parses JSON only when told it is
        return APIError(400, f"the body must be a JSON object sent as Content-Type: application/json, got Content-Type {content_type!r}")  # fmt: skip
    field = [p for p in problems if _location(p)[:1] == _location(first)[:1]]
    where = max((_location(p) for p in field), key=len)
    deepest = [p for p in field if _location(p) == where]
    param = ".".join(where) or None
    expected = " or ".join(dict.fromkeys(p["msg"] for p in deepest))
    given = deepest[0].get("input")
    came = "" if deepest[0].get("type") == "missing" else f" (got {given!r:.200})"
    return APIError(400, f"{param or 'body'}: {expected}{came}", param=param)


class _Choice:
    """One choice of a request: its text so far, made by the detokenizer, and why it ended."""

    def __init__(self, tokenizer, stop: list[str]):
        self.detokenizer = tokenizer.detokenizer(stop=tuple(stop), skip_special_tokens=True)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None  # for the client: "stop" or "length"
        self.done = False  # the engine is done with it (Finished or Failed came)
        self.failure: Failed | None = None
        self.last_token_at: float | None = None

    def on_token(self, token: int) -> str:
        if self.finish_reason is not None:
            return ""  # tokens the engine chose before it saw the cancel of a stop string
        self.completion_tokens += 1
        text = self.detokenizer.push(token)
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        return text

    def on_finished(self, result) -> str:
        self.done, self.cached_tokens = True, result.cached_tokens
        if self.finish_reason is not None:
            return ""
        text = self.detokenizer.finish()
        self.finish_reason = "stop" if result.finish_reason == "stop" or self.detokenizer.stopped else "length"
        return text


class _Generation:
    """One HTTP request's jobs on the engine thread, and their choices."""

    def __init__(self, app_state, prompt: list[int], body: protocol.SamplingFields, max_new_tokens: int):
        self.state, self.prompt = app_state, prompt
        self.arrived = time.perf_counter()
        self.first_token_seen = False
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.pending: collections.deque = collections.deque()  # events start() read that deltas() is to see
        sampled = body.temperature > 0
        self.jobs = [
            Job(
                prompt,
                max_new_tokens,
                loop,
                self.queue,
                index=index,
                temperature=body.temperature,
                top_k=body.top_k if sampled else None,
                top_p=body.top_p if sampled and body.top_p < 1 else None,
                seed=None if body.seed is None else (body.seed + index) % 2**64,
                stop_ids=app_state.tokenizer.stop_ids,
            )
            for index in range(body.n)
        ]
        self.choices = [_Choice(app_state.tokenizer, body.stop_strings()) for _ in self.jobs]

    async def start(self, param: str) -> None:
        """Submit the jobs and wait until the engine accepted every one (else raise its refusal)."""
        try:
            self.state.engine_thread.submit(self.jobs)
        except QueueFullError as error:
            raise APIError(503, f"the server is busy: {error}; retry later", "server_error") from None
        except RuntimeError as error:
            raise APIError(503, str(error), "server_error") from None
        answered, refusal = set(), None
        try:
            while len(answered) < len(self.jobs):
                index, event = await self.queue.get()
                if index in answered:  # a job's events after its acceptance: for deltas(), in order
                    self.pending.append((index, event))
                elif isinstance(event, Accepted):
                    answered.add(index)
                else:  # Failed: every job is answered Accepted or Failed before anything else
                    answered.add(index)
                    self.choices[index].done = True
                    refusal = refusal or event
        finally:
            if refusal is not None:
                self.cancel_unfinished()
        if refusal is not None:
            raise _failed_error(refusal, param)

    async def deltas(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """``(choice index, new text, finish reason or None)`` as the engine's events come, until
        every job is done."""
        metrics = self.state.metrics
        while not all(choice.done for choice in self.choices):
            index, event = self.pending.popleft() if self.pending else await self.queue.get()
            choice = self.choices[index]
            ended = choice.finish_reason is not None
            if isinstance(event, Token):
                now = time.perf_counter()
                if not ended:
                    if not self.first_token_seen:
                        metrics.time_to_first_token.observe(now - self.arrived)
                        self.first_token_seen = True
                    elif choice.last_token_at is not None:
                        metrics.inter_token_latency.observe(now - choice.last_token_at)
                    choice.last_token_at = now
                text = choice.on_token(event.token_id)
                if choice.finish_reason is not None and not ended:
                    self.state.engine_thread.cancel(self.jobs[index])  # a stop string ended it
            elif isinstance(event, Finished):
                text = choice.on_finished(event.result)
            elif isinstance(event, Failed):
                choice.done, choice.failure, text = True, event, ""
            else:  # Accepted: start() saw to it
                continue
            if text or (choice.finish_reason is not None and not ended):
                yield index, text, None if ended else choice.finish_reason

    def cancel_unfinished(self) -> None:
        for job, choice in zip(self.jobs, self.choices):
            if not choice.done:
                self.state.engine_thread.cancel(job)

    def failure(self) -> Failed | None:
        return next((choice.failure for choice in self.choices if choice.failure is not None), None)

    def usage(self) -> protocol.Usage:
        completion = sum(choice.completion_tokens for choice in self.choices)
        return protocol.Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=completion,
            total_tokens=len(self.prompt) + completion,
            prompt_tokens_details=protocol.PromptTokensDetails(cached_tokens=self.choices[0].cached_tokens),
        )


def create_app(
    model,
    tokenizer,
    cache: PagedKVCache,
    model_name: str,
    *,
    max_queued: int = 64,
    created: int | None = None,
    **engine_options,
) -> FastAPI:
    """An OpenAI-compatible app serving ``model`` (a python_ref model) on ``cache`` by an
    :class:`~kvcache_ext.Engine` (``engine_options``: ``chunk_size``, ``max_batch_size``,
    ``prefix_caching``, ``compile_decode_passes``) under the name ``model_name``. ``tokenizer``:
    text to ids and back (``encode``, ``decode``, ``apply_chat_template``, ``stop_ids``,
    ``detokenizer``; see ``python_ref/text.py``). ``max_queued``: requests that may wait for the
    engine before new ones get 503. The engine thread starts and stops with the app (its lifespan);
    stopping fails what is still in flight and writes a disk tier back; with compiled decode passes,
    the engine compiles them (``Engine.warm_up``) before the app starts serving."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty str, got {model_name!r}")
    engine = Engine(model, cache, **engine_options)
    engine_thread = EngineThread(engine, max_queued=max_queued)
    metrics = ServerMetrics(engine_thread)
    # The most tokens one request can hold (its prompt and output): what a default max_tokens fills.
    capacity = model.cfg.context_length
    if cache.window is None:
        capacity = min(capacity, cache.pool.num_blocks * cache.block_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Before the engine thread starts (it owns the engine from then on) and before the server
        # listens: the compiled decode passes' compilations (compile_decode_passes), if any.
        await asyncio.to_thread(engine.warm_up)
        engine_thread.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_thread.stop)

    app = FastAPI(title="kvcache_ext", lifespan=lifespan)
    app.state.tokenizer, app.state.engine_thread, app.state.metrics = tokenizer, engine_thread, metrics
    created = int(time.time()) if created is None else created

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return _validation_error(error, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):  # unknown paths, wrong methods
        if error.status_code == 400 and error.__cause__ is not None:  # FastAPI's "error parsing the body"
            cause = error.__cause__
            return APIError(400, f"the body is not valid JSON: {type(cause).__name__}: {cause}").response()
        return APIError(error.status_code, str(error.detail), code=str(error.status_code)).response()

    @app.get("/health")
    async def health():
        if not engine_thread.is_alive():
            raise APIError(503, "the engine thread is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> protocol.ModelList:
        return protocol.ModelList(data=[protocol.ModelCard(id=model_name, created=created)])

    def check_model(body: protocol.SamplingFields) -> None:
        if body.model != model_name:
            raise APIError(404, f"no model {body.model!r}: this server serves {model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip

    def token_limit(requested: int | None, prompt: list[int]) -> int:
        return requested if requested is not None else max(1, capacity - len(prompt) + 1)

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        check_model(body)
        prompt = tokenizer.encode(body.prompt, add_special_tokens=True) if isinstance(body.prompt, str) else body.prompt
        generation = _Generation(app.state, prompt, body, token_limit(body.max_tokens, prompt))
        return await respond(generation, body, request, "completions", completion_chunk, completion_body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
        check_model(body)
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        try:
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except (ValueError, TypeError, KeyError) as error:
            raise APIError(400, f"the chat template refused the messages: {error}", param="messages") from None
        generation = _Generation(app.state, prompt, body, token_limit(body.token_limit(), prompt))
        return await respond(generation, body, request, "chat_completions", chat_chunk, chat_body)

    def completion_chunk(request_id, index, text, finish_reason):
        choice = protocol.CompletionChoice(index=index, text=text, finish_reason=finish_reason)
        return protocol.Completion(id=request_id, created=int(time.time()), model=model_name, choices=[choice])

    def chat_chunk(request_id, index, text, finish_reason, role=None):
        delta = protocol.Delta(role=role, content=text if text or role else None)
        choice = protocol.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
        return protocol.ChatCompletionChunk(id=request_id, created=int(time.time()), model=model_name, choices=[choice])

    def completion_body(request_id, texts, generation):
        choices = [
            protocol.CompletionChoice(index=i, text=text, finish_reason=choice.finish_reason)
            for i, (text, choice) in enumerate(zip(texts, generation.choices))
        ]
        usage = generation.usage()
        return protocol.Completion(
            id=request_id, created=int(time.time()), model=model_name, choices=choices, usage=usage
        )

    def chat_body(request_id, texts, generation):
        choices = [
            protocol.ChatChoice(index=i, message=protocol.AssistantMessage(content=text), finish_reason=choice.finish_reason)
            for i, (text, choice) in enumerate(zip(texts, generation.choices))
        ]  # fmt: skip
        usage = generation.usage()
        return protocol.ChatCompletion(id=request_id, created=int(time.time()), model=model_name, choices=choices, usage=usage)  # fmt: skip

    async def respond(generation: _Generation, body, request: Request, endpoint: str, chunk, whole):
        param = "messages" if endpoint == "chat_completions" else "prompt"
        try:
            await generation.start(param)
        except APIError as error:
            metrics.requests.labels(endpoint, str(error.status)).inc()
            raise
        request_id = f"{'chatcmpl' if endpoint == 'chat_completions' else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            stream = sse_stream(generation, request_id, endpoint, chunk, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts = [[] for _ in generation.jobs]
        watcher = asyncio.create_task(cancel_on_disconnect(request, generation))
        try:
            async for index, text, _ in generation.deltas():
                texts[index].append(text)
        finally:
            watcher.cancel()
            generation.cancel_unfinished()
        failure = generation.failure()
        if failure is not None:
            metrics.requests.labels(endpoint, str(failure.status)).inc()
            raise _failed_error(failure, param)
        for choice in generation.choices:
            metrics.requests.labels(endpoint, choice.finish_reason).inc()
        return whole(request_id, ["".join(parts) for parts in texts], generation)

    async def sse_stream(generation: _Generation, request_id, endpoint, chunk, include_usage):
        def event(model_object) -> str:
            return f"data: {model_object.model_dump_json(exclude_none=endpoint == 'chat_completions')}\n\n"

        try:
            if endpoint == "chat_completions":
                for index in range(len(generation.jobs)):
                    yield event(chunk(request_id, index, "", None, role="assistant"))
            async for index, text, finish_reason in generation.deltas():
                yield event(chunk(request_id, index, text, finish_reason))
            failure = generation.failure()
            if failure is not None:
                metrics.requests.labels(endpoint, str(failure.status)).inc()
                yield event(_failed_error(failure, None).body())
            else:
                for choice in generation.choices:
                    metrics.requests.labels(endpoint, choice.finish_reason).inc()
                if include_usage:
                    last = chunk(request_id, 0, "", None)
                    yield event(last.model_copy(update={"choices": [], "usage": generation.usage()}))
            yield "data: [DONE]\n\n"
        finally:  # also when the client left (the task is cancelled): its jobs stop at the next step
            generation.cancel_unfinished()

    async def cancel_on_disconnect(request: Request, generation: _Generation) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        generation.cancel_unfinished()
        metrics.requests.labels("disconnected", "cancelled").inc()

    return app
