"""`ddtree serve`'s routes (docs/interfaces.md section 11): the OpenAI HTTP API over one DDTreeEngine.

    app = create_app(engine, model_name="tiny", budget=16, max_queue=8)     # a FastAPI app for uvicorn

GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics.
A request is checked whole before it queues (limits.py: size, time; validate.py: JSON shape, text, ids,
sampling; then types, model, unsupported parameters, the prompt against the context), so every refusal is a status code, never a half-sent stream. It then waits in the
scheduler's FIFO (429 when full) and its tokens come back step by step: `stream: true` sends one SSE
chunk per DDTree step (the text those tokens made final), a chunk with the finish_reason, the usage
chunk when stream_options.include_usage, then `data: [DONE]`. An error after the stream has begun is
sent as an SSE error object before [DONE]. usage: prompt_tokens, completion_tokens (every token the
engine committed for the request), total_tokens and "ddtree": {"steps", "mean_accept_len"} as in
ddtree-run's stats (the prefill is not a step).
"""
from __future__ import annotations

import asyncio
import secrets
import sys
import time
import traceback
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.errors import InputError
from ddtree.runtime.loop import PromptTooLongError, check_context, context_of
from ddtree.server.chat import ChatOutput, chat_prompt_ids, parser_thinking
from ddtree.server.errors import ApiError, error_body
from ddtree.server.limits import BodyLimit, Limits, endpoint_label, shown
from ddtree.server.metrics import Metrics
from ddtree.server.scheduler import Job, Scheduler
from ddtree.server.schemas import ChatRequest, CompletionRequest, Sampling, unsupported_params
from ddtree.server.streaming import TextStream, sse
from ddtree.server.validate import check_sampling, check_token_ids, load_json

DISCONNECT_POLL_S = 0.25        # while a request waits for its next step, how often it checks its client


def create_app(engine, model_name: str, budget: int = 16, max_queue: int = 8,
               limits: Limits | None = None) -> FastAPI:
    limits = limits or Limits()
    metrics = Metrics()
    scheduler = Scheduler(engine, max_queue, metrics)
    context, vocab = context_of(engine.config), engine.config.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.drain, limits.shutdown_timeout_s)   # uvicorn has drained the connections
        close = getattr(engine, "close", None)          # rank processes, where the engine has them
        if close is not None:
            close()

    app = FastAPI(title="ddtree serve", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    max_values = limits.max_json_values or context + 65536

    def refused(scope, status: int) -> None:            # a 413 / 408 from BodyLimit, counted like the others
        metrics.requests.labels(endpoint_label(app, scope), str(status)).inc()

    app.add_middleware(BodyLimit, limits=limits, count=refused)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        metrics.requests.labels(endpoint_label(app, request.scope), str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        status = 404 if e.status_code == 404 else 400 if e.status_code in (405, 422) else e.status_code
        return JSONResponse(error_body(status, f"{request.method} {shown(request.url.path)}: {e.detail}"),
                            status_code=e.status_code)

    # --- routes ---------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card()

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise ApiError(503, f"the engine is dead ({scheduler.dead or 'its worker is not running'})",
                           code="engine_dead")
        return {"status": "ok", "queue": scheduler.depth(), "running": int(scheduler.running is not None)}

    @app.get("/metrics")
    async def metrics_text():
        return Response(metrics.text(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parsed(request, CompletionRequest)
        prepare(req)
        ids = await prompt_ids(lambda: engine.encode(check_token_ids(req.single_prompt(), vocab, "prompt")),
                              "prompt")
        rid, stops = f"cmpl-{uuid.uuid4().hex}", req.stop_list()
        job = submit(req, ids, req.max_tokens)
        if req.stream:
            return streamed(request, job, req, lambda body: completion_chunk(rid, body, req), stops, None)
        text, finish, usage = await collected(request, job, stops, None)
        return answered(request, {"id": rid, "object": "text_completion", "created": int(time.time()),
                                  "model": model_name, "usage": usage,
                                  "choices": [{"index": 0, "text": text, "logprobs": None,
                                               "finish_reason": finish}]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parsed(request, ChatRequest)
        prepare(req)
        ids = await prompt_ids(lambda: chat_prompt_ids(engine.tokenizer, req), "messages")
        output = ChatOutput(parser_thinking(engine.tokenizer, req))
        rid, stops = f"chatcmpl-{uuid.uuid4().hex}", req.stop_list()
        job = submit(req, ids, req.new_tokens_limit())
        if req.stream:
            return streamed(request, job, req, lambda body: chat_chunk(rid, body, req), stops, output)
        _, finish, usage = await collected(request, job, stops, output)
        return answered(request, {"id": rid, "object": "chat.completion", "created": int(time.time()),
                                  "model": model_name, "usage": usage,
                                  "choices": [{"index": 0, "message": output.message(), "logprobs": None,
                                               "finish_reason": finish}]})

    # --- checking a request ---------------------------------------------------------------------
    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "ddtree",
                "max_model_len": context}

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"The model '{shown(name)}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def parsed(request: Request, model):
        """The body (read whole by BodyLimit) as `model`, parsed off the event loop (validate.py)."""
        return await asyncio.to_thread(parse, await request.body(), model, limits.max_json_depth, max_values)

    def prepare(req: Sampling) -> None:
        check_model(req.model)
        unsupported_params(req)
        check_sampling(req.temperature, req.top_k, req.top_p, req.seed)

    async def prompt_ids(encode, param: str) -> list[int]:
        """The prompt's token ids, encoded off the event loop (a long prompt takes a while), each id checked."""
        try:
            ids = await asyncio.to_thread(encode)
            check_context(len(ids), context)
        except PromptTooLongError as e:
            raise ApiError(400, str(e), param=param, code="context_length_exceeded") from None
        except (InputError, RecursionError) as e:
            raise ApiError(400, f"{type(e).__name__}: {shown(str(e), 300)}", param=param) from None
        return ids

    def submit(req: Sampling, ids: list[int], max_tokens: int | None) -> Job:
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        params = dict(max_new_tokens=max_tokens if max_tokens is not None else context - len(ids),
                      temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, seed=seed,
                      budget=budget)
        job = Job(ids, params, asyncio.get_running_loop())
        scheduler.submit(job)
        metrics.prompt_tokens.inc(len(ids))
        return job

    def answered(request: Request, body: dict) -> dict:
        metrics.requests.labels(endpoint_label(app, request.scope), "200").inc()
        return body

    # --- running it -----------------------------------------------------------------------------
    async def steps(request: Request, job: Job):
        """Yields each step's tokens; ends after the last; raises ApiError if the request failed.
        Leaving early (client gone, stop string) takes the job out of the queue or stops it next step."""
        finished = False
        try:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if event[0] == "tokens":
                    if await request.is_disconnected():     # checked every step: a gone client frees the engine
                        return
                    yield event[1]
                elif event[0] == "done":
                    finished = True
                    job.result = event[1]
                    return
                else:
                    finished = True
                    raise as_api_error(event[1])
        finally:
            if not finished:
                scheduler.cancel(job)

    async def run(request: Request, job: Job, stops: list[str], output: ChatOutput | None):
        """Yields (delta, None) per step (delta: text, or a chat delta dict), then (None, (finish, usage))."""
        text = TextStream(engine.tokenizer, engine.stop_ids, stops)
        chunks = []
        gen = steps(request, job)
        try:
            async for tokens in gen:
                chunks.append(tokens)
                piece = text.feed(tokens)
                yield (output.feed(piece) if output else piece), None
                if text.stopped:
                    break
            piece = text.finish()                       # the held-back rest (cut at a stop string)
            if output is not None:
                delta = output.feed(piece)
                merge_delta(delta, output.finish())
                if delta:
                    yield delta, None
            elif piece:
                yield piece, None
        finally:
            await gen.aclose()
        finish = ("tool_calls" if output is not None and output.called_tools else
                  "stop" if text.stopped else (job.result or {}).get("finish_reason") or "stop")
        yield None, (finish, usage_of(job, chunks))

    async def collected(request: Request, job: Job, stops, output):
        pieces = []
        async for delta, end in run(request, job, stops, output):
            if end is not None:
                return "".join(pieces), end[0], end[1]
            if output is None:
                pieces.append(delta)

    def streamed(request: Request, job: Job, req: Sampling, chunk, stops, output) -> StreamingResponse:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            try:
                if output is not None:
                    yield sse(chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
                async for delta, end in run(request, job, stops, output):
                    if end is None:
                        body = {"delta": delta} if output is not None else {"text": delta}
                        yield sse(chunk({**body, "finish_reason": None}))
                        continue
                    body = {"delta": {}} if output is not None else {"text": ""}
                    yield sse(chunk({**body, "finish_reason": end[0]}))
                    if include_usage:
                        yield sse({**chunk(None), "choices": [], "usage": end[1]})
                metrics.requests.labels(endpoint_label(app, request.scope), "200").inc()
            except ApiError as e:
                metrics.requests.labels(endpoint_label(app, request.scope), str(e.status)).inc()
                yield sse(e.body())
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def completion_chunk(rid: str, body: dict | None, req: Sampling) -> dict:
        out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
               "choices": [] if body is None else [{"index": 0, "logprobs": None, **body}]}
        if req.stream_options and req.stream_options.include_usage:
            out["usage"] = None
        return out

    def chat_chunk(rid: str, body: dict | None, req: Sampling) -> dict:
        out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
               "choices": [] if body is None else [{"index": 0, "logprobs": None, **body}]}
        if req.stream_options and req.stream_options.include_usage:
            out["usage"] = None
        return out

    return app


# --- helpers without the app's state ------------------------------------------------------------

def parse(body: bytes, model, max_depth: int = 32, max_values: int = 1 << 16):
    """The request body as `model`, or a 400 naming the field or limit (malformed JSON, a wrong type, ...)."""
    data = load_json(body, max_depth, max_values)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            message = f"{where}: unrecognized request argument (not a parameter ddtree serve knows)"
        else:
            message = f"{where}: {err['msg']} (got {shown(repr(err.get('input')))})"
        raise ApiError(400, message, param=where, code=err["type"]) from None


def as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InputError):
        return ApiError(400, f"{type(e).__name__}: {e}")
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    return ApiError(500, f"the request failed inside the engine: {type(e).__name__}: {e}", code="internal_error")


def merge_delta(delta: dict, more: dict) -> None:
    for key, value in more.items():
        delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value


def usage_of(job: Job, chunks: list[list[int]]) -> dict:
    """Counted from the steps the client received: the prefill's chunk, then one per DDTree step."""
    completion = sum(len(c) for c in chunks)
    n_steps = max(len(chunks) - 1, 0)
    mean_accept = (completion - len(chunks[0])) / n_steps if n_steps else 0.0
    return {"prompt_tokens": len(job.ids), "completion_tokens": completion,
            "total_tokens": len(job.ids) + completion,
            "ddtree": {"steps": n_steps, "mean_accept_len": mean_accept}}
