"""Chat: the prompt from messages (+ tools, thinking) and the assistant's text -> OpenAI chat deltas.

    ids = chat_prompt_ids(tokenizer, req)                  # the checkpoint's own template (docs/kimi-k2.md section 7)
    out = ChatOutput(parser_thinking(tokenizer, req))
    out.feed(text) -> delta dict                           # {"reasoning_content"?, "content"?, "tool_calls"?}
    out.finish() -> delta dict
    out.message() -> the whole assistant message; out.called_tools: any tool call seen

The model's text is split by ddtree/model/tool_calls.py AssistantParser: the thinking section (the
prompt ends in <think> when thinking is on) becomes `reasoning_content`, the tool-call tokens become
`tool_calls` (streamed as OpenAI deltas: the first delta of a call carries its index, id, type and
name; later ones append to `function.arguments`), the rest is `content`.
"""
from __future__ import annotations

from ddtree.model.tool_calls import AssistantParser
from ddtree.server.schemas import ChatRequest


def chat_messages(req: ChatRequest) -> list[dict]:
    """The messages as dicts for the template; 'developer' is OpenAI's newer name for 'system'."""
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


def tools_on(req: ChatRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def chat_prompt_ids(tokenizer, req: ChatRequest) -> list[int]:
    """The prompt: messages and (unless tool_choice is "none") tools through the checkpoint's template."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if tools_on(req) else None
    return tokenizer.encode_chat(chat_messages(req), tools=tools, thinking=req.thinking())


def parser_thinking(tokenizer, req: ChatRequest) -> bool:
    """Whether the answer starts inside <think>: the template's default (on) unless the request turned it
    off, and always on for a template without the switch (K2-Thinking)."""
    thinking = req.thinking()
    return True if thinking is None or not getattr(tokenizer, "thinking_switch", True) else thinking


class ChatOutput:
    def __init__(self, thinking: bool):
        self.parser = AssistantParser(thinking)
        self.reasoning, self.content = [], []
        self.calls: dict[int, dict] = {}        # index -> {"id", "type", "function": {"name", "arguments"}}

    @property
    def called_tools(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> dict:
        return self._delta(self.parser.feed(text) if text else [])

    def finish(self) -> dict:
        return self._delta(self.parser.finish())

    def _delta(self, events) -> dict:
        delta: dict = {}
        for event in events:
            kind = event[0]
            if kind in ("reasoning", "content"):
                key = "reasoning_content" if kind == "reasoning" else "content"
                (self.reasoning if kind == "reasoning" else self.content).append(event[1])
                delta[key] = delta.get(key, "") + event[1]
            elif kind == "tool_call":
                self._tool_call(delta, *event[1:])
        return delta

    def _tool_call(self, delta: dict, index: int, call_id, name, arguments: str) -> None:
        calls = delta.setdefault("tool_calls", [])
        part = next((c for c in calls if c["index"] == index), None)
        if index not in self.calls:
            self.calls[index] = {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
            part = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
            calls.append(part)
        elif part is None:
            part = {"index": index, "function": {"arguments": ""}}
            calls.append(part)
        self.calls[index]["function"]["arguments"] += arguments or ""
        part["function"]["arguments"] += arguments or ""

    def message(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.content) if self.content or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return message
