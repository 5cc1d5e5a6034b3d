"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models.

Strict types (a string where a number belongs is a 400, never coerced) and no unknown fields: a
parameter this server does not know is a 400 naming it, never silently ignored. Parameters it knows
but does not implement (penalties, response_format other than text, ...) are checked in
`unsupported_params`: a 400 naming the parameter when set to anything but its default.

Accepted and ignored, because they never change the output (IGNORED_FIELDS, listed in docs/serving.md):
`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`. Implemented: `logprobs` /
`top_logprobs` (server/logprobs.py), `logit_bias` (OpenAI's shape: token id string -> bias in
[-100, 100], added to the logits) and vLLM's `ignore_eos`.

Sampling follows docs/interfaces.md section 5: temperature 0 is greedy, top_k 0 (or -1, vLLM's "off")
keeps every token, top_p 1 keeps all, and `seed` picks the Philox stream (no seed: a random one).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddtree.server.errors import ApiError, unsupported
from ddtree.server.limits import shown
from ddtree.server.validate import load_json

MAX_STOPS = 4                           # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20                   # vLLM's default max_logprobs
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None       # parts: only {"type": "text"} (check_content)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None                # sent back by clients that echo an assistant message


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None      # a JSON schema, declared to the model as the template does
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class Sampling(Strict):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                            # -1 or 0: off
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    logit_bias: dict[str, Union[int, float]] | None = None  # {"token id": bias in [-100, 100]}
    ignore_eos: bool = False                                # vLLM: no stop token ends the run
    # accepted and ignored: they never change the output (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    n: int = Field(1, ge=1)                                 # choices: n jobs, seeds seed + i (server/choices.py)
    # known, not implemented: a 400 when not at the default (unsupported_params)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def bias_by_id(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with integer keys, checked: ids in the vocabulary, biases in [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                raise ApiError(400, f"logit_bias: key {key!r} is not a token id in 0..{vocab_size - 1}",
                               param="logit_bias")
            if not -100 <= bias <= 100:
                raise ApiError(400, f"logit_bias[{key!r}]: {bias} is outside [-100, 100]", param="logit_bias")
            out[int(key)] = float(bias)
        return out

    def top_logprobs_n(self) -> int | None:
        """None: no logprobs; else how many alternatives each token lists (0: only the chosen token)."""
        return None

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop: at most {MAX_STOPS} stop sequences, got {len(stops)}", param="stop")
        return stops


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)   # the top alternatives per token
    suffix: str | None = None

    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """str or token ids; a list of one prompt is that prompt; several prompts are a 400."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt: a batch of {len(p)} prompts is not supported; send one prompt "
                               "per request", param="prompt", code="unsupported_parameter")
            p = p[0]
        if isinstance(p, list) and not p:
            raise ApiError(400, "prompt: an empty list of token ids", param="prompt")
        return p


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    reasoning_effort: str | None = None

    def new_tokens_limit(self) -> int | None:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ApiError(400, f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                           f"({self.max_completion_tokens}) disagree; give one", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: only allowed when logprobs is true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_content(self) -> None:
        """Every content part is {"type": "text", "text": str}; anything else is a 400 naming the part."""
        for i, m in enumerate(self.messages):
            for k, part in enumerate(m.content if isinstance(m.content, list) else []):
                where = f"messages.{i}.content.{k}"
                kind = part.get("type")
                if kind != "text":
                    raise ApiError(400, f"{where}: content part type {kind!r} is not supported: ddtree serve is "
                                   "text-only (only {'type': 'text', 'text': ...} parts)", param=where,
                                   code="unsupported_content_part")
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}.text: a text part needs a string 'text'", param=f"{where}.text")

    def thinking(self) -> bool | None:
        """chat_template_kwargs.thinking (the Kimi template's variable); None: the template's default."""
        kwargs = self.chat_template_kwargs or {}
        unknown = sorted(set(kwargs) - {"thinking"})
        if unknown:
            raise ApiError(400, f"chat_template_kwargs.{unknown[0]}: the Kimi chat template reads only "
                           "'thinking'", param=f"chat_template_kwargs.{unknown[0]}")
        thinking = kwargs.get("thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise ApiError(400, f"chat_template_kwargs.thinking: expected true or false, got {thinking!r}",
                           param="chat_template_kwargs.thinking")
        return thinking


def unsupported_params(req: Sampling) -> None:
    """A 400 naming the first parameter set to a value this server does not implement."""
    defaults = [("presence_penalty", 0.0), ("frequency_penalty", 0.0)]
    for name, default in defaults:
        if getattr(req, name) != default:
            raise unsupported(name, getattr(req, name))
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    if isinstance(req, CompletionRequest):
        for name, off in (("echo", False), ("best_of", None), ("suffix", None)):
            value = getattr(req, name)
            if value != off and not (name == "best_of" and value == 1):
                raise unsupported(name, value)
    if isinstance(req, ChatRequest):
        req.check_content()
        req.top_logprobs_n()
        if req.response_format is not None and req.response_format != {"type": "text"}:
            raise unsupported("response_format", req.response_format, " (only {'type': 'text'})")
        if req.reasoning_effort is not None:
            raise unsupported("reasoning_effort", req.reasoning_effort,
                              " (use chat_template_kwargs.thinking)")
        if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
            raise unsupported("tool_choice", req.tool_choice, " (only 'auto' and 'none')")


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
