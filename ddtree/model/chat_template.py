"""Kimi K2.x chat format: a list of OpenAI-style messages -> the prompt text the model was trained on.

A hand-written equivalent of the checkpoint's `chat_template.jinja` (no jinja2 at run time). The
reference is Kimi K2.5's template, kept verbatim in tests/fixtures/kimi/k2.5_chat_template.jinja
(source: lightseekorg/smg crates/tokenizer/tests/fixtures/kimi_k25/chat_template.jinja, a vendored
copy of moonshotai/Kimi-K2.5 chat_template.jinja); tests/model/test_chat_template.py renders that
file with jinja2 the way transformers does and compares byte for byte.

What the template does (and this module does the same):
- every turn is  MARKER NAME <|im_middle|> BODY <|im_end|>  with MARKER <|im_user|> for user,
  <|im_assistant|> for assistant and <|im_system|> for everything else (system, tool,
  tool_declare); NAME is the message's "name" if set, else its role;
- tools are declared first, as a `tool_declare` system turn;
- assistant turns up to and including the last assistant turn *without* tool calls are history:
  their reasoning is dropped to `<think></think>`; later assistant turns (the current tool-call
  loop) keep `<think>{reasoning_content}</think>` unless thinking is off;
- a tool call is <|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>, all the
  calls of one turn wrapped in <|tool_calls_section_begin|> ... <|tool_calls_section_end|>;
- a tool result body is "## Return of ID\\n" + content;
- the generation prompt is <|im_assistant|>assistant<|im_middle|> then <think> (thinking on, the
  default) or <think></think> (thinking off); K2-Thinking's template has no thinking switch and
  stops at <|im_middle|> (render_chat(thinking_switch=False)). No [BOS] is emitted.

Two knobs the K2.5 template reads from outside:
- `tools_ts_str`: K2.5+'s tokenizer wrapper turns `tools` into a TypeScript-style namespace and
  passes it in; without it the template falls back to compact JSON of the (key-sorted) tools,
  which is what `render_chat` emits unless the caller passes the declaration text.
- the default system prompt: K2-Thinking's template (fixture k2-thinking_chat_template.jinja,
  source ggml-org/llama.cpp models/templates/moonshotai-Kimi-K2-Thinking.jinja) inserts
  KIMI_DEFAULT_SYSTEM after the tool declaration when the conversation does not start with a
  system turn; K2.5's does not. `default_system` selects either; the tokenizer loader reads the
  checkpoint's own template to decide (see tokenizer.KimiTokenizer.from_dir).
"""
from __future__ import annotations

import json

from ddtree.errors import InputError

# Interoperability constant, byte-exact from moonshotai Kimi-K2-Thinking chat_template.jinja
# (copy: ggml-org/llama.cpp models/templates/moonshotai-Kimi-K2-Thinking.jinja).
KIMI_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

ROLE_MARKERS = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}   # every other role: <|im_system|>
SYSTEM_MARKER = "<|im_system|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN, TOOL_CALL_ARGS, TOOL_CALL_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                                  "<|tool_call_end|>")


class ChatFormatError(InputError):
    """A message list the Kimi chat format cannot render."""


def render_chat(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                thinking: bool | None = True, default_system: str | None = None,
                tools_ts_str: str | None = None, thinking_switch: bool = True) -> str:
    """The prompt text for `messages` (see the module docstring for the format); thinking None is
    the template's default (the variable undefined: on). thinking_switch False renders a template
    without the `thinking` variable (K2-Thinking's): reasoning always kept in the current tool-call
    loop, and a generation prompt that ends at <|im_middle|> (the model opens <think> itself)."""
    _check_messages(messages)
    thinking = True if thinking is None or not thinking_switch else thinking
    # history ends at the last assistant turn without tool calls (-1: no history)
    last_plain_assistant = max((i for i, m in enumerate(messages)
                                if m["role"] == "assistant" and not m.get("tool_calls")), default=-1)
    turns = []
    if tools:
        declaration = tools_ts_str or json.dumps(_deep_sorted(tools), ensure_ascii=False, separators=(",", ":"))
        turns.append(_turn(SYSTEM_MARKER, "tool_declare", declaration))
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        turns.append(_turn(SYSTEM_MARKER, "system", default_system))
    for i, message in enumerate(messages):
        keep_reasoning = thinking and i > last_plain_assistant
        turns.append(_render_message(message, i, keep_reasoning))
    if add_generation_prompt:
        turns.append(ROLE_MARKERS["assistant"] + "assistant" + IM_MIDDLE
                     + ("" if not thinking_switch else THINK_OPEN if thinking else THINK_OPEN + THINK_CLOSE))
    return "".join(turns)


def _turn(marker: str, name: str, body: str) -> str:
    return marker + name + IM_MIDDLE + body + IM_END


def _render_message(message: dict, index: int, keep_reasoning: bool) -> str:
    role = message["role"]
    name = message.get("name") or role
    marker = ROLE_MARKERS.get(role, SYSTEM_MARKER)
    text = _content_text(message, index)
    if role == "assistant":
        reasoning = (message.get("reasoning_content") or "") if keep_reasoning else ""
        body = THINK_OPEN + reasoning + THINK_CLOSE + text
        if message.get("tool_calls"):
            body += _render_tool_calls(message["tool_calls"], index)
    elif role == "tool":
        if not message.get("tool_call_id"):
            raise ChatFormatError(f"messages[{index}]: a 'tool' message needs 'tool_call_id' "
                                  "(the id of the call it answers, e.g. 'functions.get_weather:0')")
        body = f"## Return of {message['tool_call_id']}\n" + text
    else:
        body = text
    return _turn(marker, name, body)


def _render_tool_calls(tool_calls: list[dict], index: int) -> str:
    calls = []
    for k, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{k}]"
        if not isinstance(call, dict) or "id" not in call or "function" not in call:
            raise ChatFormatError(f"{where}: expected {{'id': ..., 'function': {{'name': ..., 'arguments': ...}}}}")
        args = call["function"].get("arguments", "")
        # a JSON string is emitted as given; a dict goes through json.dumps like the template's tojson
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(TOOL_CALL_BEGIN + str(call["id"]) + TOOL_CALL_ARGS + args_text + TOOL_CALL_END)
    return TOOL_CALLS_BEGIN + "".join(calls) + TOOL_CALLS_END


def _content_text(message: dict, index: int) -> str:
    """String content as is; a list of parts is the concatenation of its text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"messages[{index}].content: expected a string, a list of parts or None, "
                              f"got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(f"messages[{index}].content[{k}]: only text parts are supported "
                                  f"(this engine is text-only), got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _check_messages(messages) -> None:
    if not isinstance(messages, list):
        raise ChatFormatError(f"messages: expected a list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatFormatError(f"messages[{i}]: expected a dict with a string 'role', got {m!r}")


def _deep_sorted(value):
    """Dicts with their keys sorted at every depth (the Kimi tokenizer sorts `tools` this way
    before rendering, so the declaration does not depend on the caller's key order)."""
    if isinstance(value, dict):
        return {k: _deep_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_deep_sorted(v) for v in value]
    return value
