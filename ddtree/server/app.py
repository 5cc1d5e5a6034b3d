"""`ddtree serve`'s routes (docs/interfaces.md section 11): the OpenAI HTTP API over one DDTreeEngine.

    app = create_app(engine, ["tiny"], budget=16, max_queue=8)     # a FastAPI app for uvicorn
    (optional: api_key=, allowed_origins=[...], max_model_len=, log_requests=, max_num_seqs=; docs/serving.md)

GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics, and vLLM's
/tokenize, /detokenize, /version, /ping (server/utility_routes.py). --api-key guards /v1/* (server/auth.py).
A request is checked whole before it queues (limits.py: size, time; validate.py: JSON shape, text, ids,
sampling; then types, model, unsupported parameters, the prompt against the context), so every refusal is a status code, never a half-sent stream. It then waits in the
scheduler's FIFO (429 when full) and its tokens come back step by step: `stream: true` sends one SSE
chunk per DDTree step (the text those tokens made final), a chunk with the finish_reason, the usage
chunk when stream_options.include_usage, then `data: [DONE]`. An error after the stream has begun is
sent as an SSE error object before [DONE]. usage: prompt_tokens, completion_tokens (every token the
engine committed for the request, up to and including the one that completed a stop string), total_tokens
and "ddtree": {"steps", "mean_accept_len"} as in ddtree-run's stats (the prefill is not a step).
One log line per request (unless log_requests=False): id, status, prompt / completion tokens, latency.
`n` > 1 is n jobs of the scheduler (all queued or none), choice i sampled with seed (seed + i) mod 2^64
(no seed: a random base), so choice i is the request with n = 1 and that seed; their streams interleave as
chunks with "index": i; usage sums the choices' completion tokens (the prompt counted once).
--max-num-seqs N > 1: the continuous-batching scheduler (server/batch_scheduler.py), else the FIFO one.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
import traceback
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.errors import InputError
from ddtree.runtime.loop import PromptTooLongError, check_context, context_of
from ddtree.runtime.request import GenerationRequest
from ddtree.server.auth import add_access_middleware
from ddtree.server.batch_scheduler import BatchScheduler
from ddtree.server.chat import ChatOutput, chat_prompt_ids, parser_thinking
from ddtree.server.choices import choice_seeds, merged, merged_usage
from ddtree.server.errors import ApiError, error_body
from ddtree.server.limits import BodyLimit, Limits, endpoint_label, shown
from ddtree.server.logprobs import chat_logprobs, completion_logprobs
from ddtree.server.metrics import Metrics
from ddtree.server.scheduler import Job, Scheduler
from ddtree.server.schemas import ChatRequest, CompletionRequest, Sampling, parse, unsupported_params
from ddtree.server.streaming import TextStream, sse
from ddtree.server.utility_routes import add_utility_routes
from ddtree.server.validate import check_sampling, check_token_ids

DISCONNECT_POLL_S = 0.25        # while a request waits for its next step, how often it checks its client
log = logging.getLogger("ddtree.serve")


def create_app(engine, model_names: str | list[str], budget: int | str = 16, max_queue: int = 8, prune: str = "off",
               api_key: str | None = None, allowed_origins: list[str] | None = None,
               max_model_len: int | None = None, log_requests: bool = True,
               limits: Limits | None = None, max_num_seqs: int = 1) -> FastAPI:
    """model_names: the ids clients may send (the first names the metrics); budget: per DDTree step, or
    "auto" (the engine dir's tuning file); max_model_len: the context the server allows (<= the model's);
    max_num_seqs: requests generated at once (> 1: continuous batching, CPU executors); prune: every request's
    --prune ("auto": runtime/pruning.py, the FIFO scheduler)."""
    if prune == "auto" and max_num_seqs > 1:
        raise ValueError("prune 'auto' runs with the FIFO scheduler (max_num_seqs 1): the batched verify does not "
                         "prune")
    names = [model_names] if isinstance(model_names, str) else list(model_names)
    limits = limits or Limits()
    metrics = Metrics(names[0])
    scheduler = (BatchScheduler(engine, max_queue, metrics, max_num_seqs) if max_num_seqs > 1
                 else Scheduler(engine, max_queue, metrics))
    context = min(context_of(engine.config), max_model_len or context_of(engine.config))
    vocab = engine.config.vocab_size
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
    add_access_middleware(app, api_key, allowed_origins)
    max_values = limits.max_json_values or context + 65536

    def refused(scope, status: int) -> None:            # a 413 / 408 from BodyLimit, counted like the others
        metrics.answered(endpoint_label(app, scope), status)

    app.add_middleware(BodyLimit, limits=limits, count=refused)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        metrics.answered(endpoint_label(app, request.scope), e.status)
        log_request("-", request.url.path, e.status, None, None)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        status = 404 if e.status_code == 404 else 400 if e.status_code in (405, 422) else e.status_code
        return JSONResponse(error_body(status, f"{request.method} {request.url.path}: {e.detail}"),
                            status_code=e.status_code)

    # --- routes ---------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card(name)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise ApiError(503, f"the engine is dead ({scheduler.dead or 'its worker is not running'})",
                           code="engine_dead")
        return {"status": "ok", "queue": scheduler.depth(), "running": scheduler.n_running()}

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
        jobs = submit(req, ids, req.max_tokens)
        outputs = [None] * len(jobs)
        if req.stream:
            return streamed(request, jobs, req, rid, lambda body, i=0: completion_chunk(rid, body, req, i), stops,
                            outputs)
        ends = await collected(request, jobs, stops, outputs)
        choices = [{"index": i, "text": text, "finish_reason": end.finish,
                    "logprobs": completion_logprobs(engine.tokenizer, end.entries, end.offsets)
                    if end.entries is not None else None} for i, (text, end) in enumerate(ends)]
        return answered(request, rid, jobs[0], {"id": rid, "object": "text_completion", "created": int(time.time()),
                                                "model": req.model, "usage": merged_usage([e.usage for _, e in ends]),
                                                "choices": choices})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parsed(request, ChatRequest)
        prepare(req)
        ids = await prompt_ids(lambda: chat_prompt_ids(engine.tokenizer, req), "messages")
        rid, stops = f"chatcmpl-{uuid.uuid4().hex}", req.stop_list()
        jobs = submit(req, ids, req.new_tokens_limit())
        outputs = [ChatOutput(parser_thinking(engine.tokenizer, req)) for _ in jobs]
        if req.stream:
            return streamed(request, jobs, req, rid, lambda body, i=0: chat_chunk(rid, body, req, i), stops, outputs)
        ends = await collected(request, jobs, stops, outputs)
        choices = [{"index": i, "message": output.message(), "finish_reason": end.finish,
                    "logprobs": chat_logprobs(engine.tokenizer, end.entries) if end.entries is not None else None}
                   for i, (output, (_, end)) in enumerate(zip(outputs, ends))]
        return answered(request, rid, jobs[0], {"id": rid, "object": "chat.completion", "created": int(time.time()),
                                                "model": req.model, "usage": merged_usage([e.usage for _, e in ends]),
                                                "choices": choices})

    # --- checking a request ---------------------------------------------------------------------
    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "ddtree", "root": names[0],
                "max_model_len": context}

    def check_model(name: str) -> None:
        if name not in names:
            raise ApiError(404, f"The model '{shown(name)}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in names)}", param="model", code="model_not_found")

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

    def submit(req: Sampling, ids: list[int], max_tokens: int | None) -> list[Job]:
        """The request's n choices as n jobs, queued together (or none: 429 / 400)."""
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        room = context - len(ids)                       # --max-model-len may be below the model's context
        bias = req.bias_by_id(engine.config.vocab_size) or None
        loop = asyncio.get_running_loop()
        jobs = [Job(ids, GenerationRequest(max_new_tokens=min(max_tokens, room) if max_tokens is not None else room,
                                           temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                                           seed=choice_seed, budget=budget, logit_bias=bias,
                                           ignore_eos=bool(req.ignore_eos), prune=prune),
                    loop, top_logprobs=req.top_logprobs_n()) for choice_seed in choice_seeds(seed, req.n)]
        scheduler.submit(*jobs)
        metrics.prompt_tokens.inc(len(ids))
        return jobs

    def answered(request: Request, rid: str, job: Job, body: dict) -> dict:
        metrics.answered(endpoint_label(app, request.scope), 200)
        log_request(rid, request.url.path, 200, body["usage"], job.arrived)
        return body

    def log_request(rid: str, path: str, status: int, usage: dict | None, arrived: float | None) -> None:
        if not log_requests:
            return
        tokens = (f", prompt {usage['prompt_tokens']} tokens, completion {usage['completion_tokens']} tokens"
                  if usage else "")
        latency = f", {time.perf_counter() - arrived:.3f} s" if arrived is not None else ""
        log.info("request %s %s: status %s%s%s", rid, path, status, tokens, latency)

    # --- running it -----------------------------------------------------------------------------
    async def steps(request: Request, job: Job):
        """Yields each step's (tokens, logprobs entries or None); ends after the last; raises ApiError if the
        request failed. Leaving early (client gone, stop string) takes the job out of the queue or stops it
        next step."""
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
                    yield event[1], event[2]
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
        """Yields Piece(delta, logprobs, offsets) per step (delta: text, or a chat delta dict), then End.
        Tokens past the one that completed a stop string are dropped: not shown, not counted."""
        text = TextStream(engine.tokenizer, engine.stop_ids, stops)
        chunks, entries, offsets = [], [], []
        with_logprobs = job.top_logprobs is not None
        gen = steps(request, job)
        try:
            async for tokens, logprobs in gen:
                piece, used, step_offsets = text.feed_step(tokens)
                chunks.append(tokens[:used])
                step_logprobs = logprobs[:used] if logprobs is not None else None
                if step_logprobs is not None:
                    entries.extend(step_logprobs)
                    offsets.extend(step_offsets)
                yield Piece(output.feed(piece) if output else piece, step_logprobs, step_offsets)
                if text.stopped:
                    break
            piece = text.finish()                       # the held-back rest (cut at a stop string)
            if output is not None:
                delta = output.feed(piece)
                merge_delta(delta, output.finish())
                if delta:
                    yield Piece(delta, [] if with_logprobs else None, [])
            elif piece:
                yield Piece(piece, [] if with_logprobs else None, [])
        finally:
            await gen.aclose()
        finish = ("tool_calls" if output is not None and output.called_tools else
                  "stop" if text.stopped else (job.result or {}).get("finish_reason") or "stop")
        metrics.finished(finish)
        yield End(finish, usage_of(job, chunks), entries if with_logprobs else None, offsets)

    async def collected(request: Request, jobs: list[Job], stops, outputs) -> list[tuple[str, End]]:
        """Every choice's (text, End), in choice order; a choice that fails stops the others."""
        pieces, ends = [[] for _ in jobs], [None] * len(jobs)
        async for i, item in merged([run(request, job, stops, out) for job, out in zip(jobs, outputs)]):
            if isinstance(item, End):
                ends[i] = item
            elif outputs[i] is None:
                pieces[i].append(item.delta)
        return [("".join(p), end) for p, end in zip(pieces, ends)]

    def streamed(request: Request, jobs: list[Job], req: Sampling, rid: str, chunk, stops, outputs
                 ) -> StreamingResponse:
        chat = outputs[0] is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def logprobs_of(piece: Piece):
            if piece.logprobs is None:
                return None
            if chat:
                return chat_logprobs(engine.tokenizer, piece.logprobs)
            return completion_logprobs(engine.tokenizer, piece.logprobs, piece.offsets)

        async def events():
            status, usage, usages = 200, None, []
            try:
                if chat:
                    for i in range(len(jobs)):
                        yield sse(chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, i))
                async for i, item in merged([run(request, job, stops, out) for job, out in zip(jobs, outputs)]):
                    if isinstance(item, Piece):
                        body = {"delta": item.delta} if chat else {"text": item.delta}
                        yield sse(chunk({**body, "logprobs": logprobs_of(item), "finish_reason": None}, i))
                        continue
                    usages.append(item.usage)
                    body = {"delta": {}} if chat else {"text": ""}
                    yield sse(chunk({**body, "finish_reason": item.finish}, i))
                usage = merged_usage(usages)
                if include_usage:
                    yield sse({**chunk(None), "choices": [], "usage": usage})
            except ApiError as e:
                status = e.status
                yield sse(e.body())
            metrics.answered(endpoint_label(app, request.scope), status)
            log_request(rid, request.url.path, status, usage, jobs[0].arrived)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def completion_chunk(rid: str, body: dict | None, req: Sampling, index: int = 0) -> dict:
        out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
               "choices": [] if body is None else [{"index": index, "logprobs": None, **body}]}
        if req.stream_options and req.stream_options.include_usage:
            out["usage"] = None
        return out

    def chat_chunk(rid: str, body: dict | None, req: Sampling, index: int = 0) -> dict:
        out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model,
               "choices": [] if body is None else [{"index": index, "logprobs": None, **body}]}
        if req.stream_options and req.stream_options.include_usage:
            out["usage"] = None
        return out

    add_utility_routes(app, engine, context, check_model)
    return app


# --- helpers without the app's state ------------------------------------------------------------

@dataclass
class Piece:
    delta: str | dict                   # completions: text; chat: a delta dict
    logprobs: list | None               # this step's entries (server/logprobs.py), None without logprobs
    offsets: list[int]                  # each entry's character offset in the output (completions)


@dataclass
class End:
    finish: str
    usage: dict
    entries: list | None                # every token's logprobs entry, None without logprobs
    offsets: list[int]


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
