"""vLLM's utility routes: POST /tokenize, POST /detokenize, GET /version, GET|POST /ping.

    POST /tokenize   {"prompt": str}                            -> {"count", "max_model_len", "tokens"}
                     {"messages": [...], "tools"?, "chat_template_kwargs"?, "add_generation_prompt"?: true}
                     (+ "return_token_strs": true adds "token_strs"); the ids the completion / chat routes
                     would feed the model: the same encode and chat template
    POST /detokenize {"tokens": [int]}                          -> {"prompt": str}
    GET  /version                                               -> {"version": ddtree's version}
    GET|POST /ping                                              -> 200, empty (SageMaker's health probe)

"model" is optional; when given it must be a served name (404 otherwise). add_special_tokens is accepted for
vLLM's clients and must stay false-like in effect: ddtree adds no [BOS] to a prompt either way.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from ddtree.errors import InputError
from ddtree.server.chat import chat_messages, tools_on
from ddtree.server.errors import ApiError
from ddtree.server.schemas import ChatMessage, ChatRequest, Strict, Tool, parse
from ddtree.version import __version__


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def add_utility_routes(app, engine, context: int, check_model) -> None:
    tokenizer = engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(await request.body(), TokenizeRequest)
        if req.model is not None:
            check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "tokenize: give exactly one of 'prompt' (text) or 'messages' (chat)",
                           param="prompt")
        try:
            if req.prompt is not None:
                ids = tokenizer.encode(req.prompt)
            else:
                chat = ChatRequest.model_validate({"model": "-", "messages": req.messages, "tools": req.tools,
                                                   "chat_template_kwargs": req.chat_template_kwargs})
                chat.check_content()
                tools = [t.model_dump(exclude_none=True) for t in chat.tools] if tools_on(chat) else None
                ids = tokenizer.encode_chat(chat_messages(chat), tools=tools,
                                            add_generation_prompt=req.add_generation_prompt, thinking=chat.thinking())
        except InputError as e:
            raise ApiError(400, f"{type(e).__name__}: {e}", param="messages" if req.messages else "prompt") from None
        out = {"count": len(ids), "max_model_len": context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tokenizer.decode_bytes([t]).decode("utf-8", errors="replace") for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(await request.body(), DetokenizeRequest)
        if req.model is not None:
            check_model(req.model)
        try:
            return {"prompt": tokenizer.decode(req.tokens)}
        except InputError as e:
            raise ApiError(400, f"tokens: {e}", param="tokens") from None

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200)
