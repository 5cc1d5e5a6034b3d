"""Kimi K2.x assistant output -> OpenAI reasoning_content / content / tool_calls, also incrementally.

What the model writes after the generation prompt (the format of chat_template.jinja's assistant
turn, tests/fixtures/kimi/k2.5_chat_template.jinja, and docs/kimi-k2.md section 7):

    REASONING</think>CONTENT<|tool_calls_section_begin|>
        <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|> ...
    <|tool_calls_section_end|><|im_end|>

- thinking on: the prompt ends inside `<think>`, so the text up to `</think>` is reasoning;
  a tool-call section opened before `</think>` also ends the reasoning;
- thinking off: the prompt ends `<think></think>`; all text outside the section is content;
- either way, output that starts with `<think>` opens reasoning there (K2-Thinking's prompt has
  no `<think>` and no thinking switch: the model opens it itself);
- a call's id is the text between `<|tool_call_begin|>` and `<|tool_call_argument_begin|>`,
  kept whole (`functions.get_weather:0`): the template writes `tool_calls[i].id` there and a tool
  result names it in "## Return of ID", so the id round-trips; the function name is the id
  without `functions.` and `:IDX`;
- ARGS (JSON text) is passed through as written, streamed as it arrives;
- `<|im_end|>` ends the message: anything after it is ignored.
A special token split across two chunks is held back until the next chunk (or finish) resolves it.
A call cut off before its `<|tool_call_argument_begin|>` (generation hit its length) is dropped.

Events: ("reasoning", text) | ("content", text) | ("tool_call", index, id, name, arguments_delta);
a call's first event has arguments_delta "" when its arguments have not started yet.
"""
from __future__ import annotations

from ddtree.model.chat_template import (
    IM_END,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_ARGS,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
)
from ddtree.model.tool_declaration import ToolSchemaError, render_tools

__all__ = ["AssistantParser", "ToolSchemaError", "parse_assistant", "render_tools", "collect"]

REASONING, CONTENT, SECTION, CALL_ID, CALL_ARGS, DONE = "reasoning", "content", "section", "call_id", "args", "done"

# state -> {marker: next state}; the earliest marker found in the text wins
TRANSITIONS = {
    REASONING: {THINK_CLOSE: CONTENT, TOOL_CALLS_BEGIN: SECTION, IM_END: DONE},
    CONTENT: {TOOL_CALLS_BEGIN: SECTION, TOOL_CALL_BEGIN: CALL_ID, IM_END: DONE},
    SECTION: {TOOL_CALL_BEGIN: CALL_ID, TOOL_CALLS_END: CONTENT, IM_END: DONE},
    CALL_ID: {TOOL_CALL_ARGS: CALL_ARGS, TOOL_CALL_END: SECTION, TOOL_CALLS_END: CONTENT, IM_END: DONE},
    CALL_ARGS: {TOOL_CALL_END: SECTION, TOOL_CALLS_END: CONTENT, IM_END: DONE},
}


def function_name(call_id: str) -> str:
    """functions.get_weather:0 -> get_weather (the template's id convention)."""
    head = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return head.removeprefix("functions.")


def held_back(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class AssistantParser:
    """Feed the decoded output text chunk by chunk; each call returns the events it completed."""

    def __init__(self, thinking: bool):
        self.state = REASONING if thinking else CONTENT
        self.at_start = True              # a leading <think> (opening reasoning) may still come
        self.pending = ""                 # text not yet consumed (a possible marker's start)
        self.calls = 0                    # tool calls opened so far
        self.call_id = ""                 # the open call's id text
        self.call_started = False         # its header event was sent

    def feed(self, text: str) -> list[tuple]:
        self.pending += text
        return _merged(self._consume(final=False))

    def finish(self) -> list[tuple]:
        return _merged(self._consume(final=True))

    def _consume(self, final: bool):
        events = []
        if self.at_start:
            if not final and THINK_OPEN.startswith(self.pending):
                return events             # maybe a <think> still arriving
            if self.pending.startswith(THINK_OPEN):
                self.pending, self.state = self.pending[len(THINK_OPEN):], REASONING
            self.at_start = False
        while self.state != DONE and self.pending:
            markers = TRANSITIONS[self.state]
            found = [(self.pending.find(m), m) for m in markers]
            found = [(at, m) for at, m in found if at >= 0]
            if found:
                at, marker = min(found)
                events += self._text(self.pending[:at])
                self.pending = self.pending[at + len(marker):]
                events += self._enter(markers[marker], marker)
                continue
            keep = 0 if final else held_back(self.pending, markers)
            events += self._text(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        if self.state == DONE:
            self.pending = ""
        return events

    def _text(self, text: str) -> list[tuple]:
        """Text inside the current state (no marker in it)."""
        if not text:
            return []
        if self.state in (REASONING, CONTENT):
            return [(self.state, text)]
        if self.state == CALL_ID:
            self.call_id += text
            return []
        if self.state == CALL_ARGS:
            return [self._call_event(text)]
        return []                         # between calls inside the section: whitespace, dropped

    def _enter(self, state: str, marker: str) -> list[tuple]:
        events = []
        if self.state == CALL_ID and marker in (TOOL_CALL_ARGS, TOOL_CALL_END):
            events.append(self._call_event(""))          # the id is complete: announce the call
        if self.state in (CALL_ID, CALL_ARGS) and state != CALL_ARGS:
            self.calls += self.call_started               # the call is over (or dropped if never announced)
            self.call_started = False
        if state == CALL_ID:
            self.call_id = ""
        self.state = state
        return events

    def _call_event(self, delta: str) -> tuple:
        self.call_started = True
        call_id = self.call_id.strip()
        return ("tool_call", self.calls, call_id, function_name(call_id), delta)


def _merged(events: list[tuple]) -> list[tuple]:
    """Neighbouring text events of one kind (or deltas of one call) joined into one."""
    out = []
    for event in events:
        if out and out[-1][0] == event[0] and out[-1][:-1] == event[:-1]:
            out[-1] = out[-1][:-1] + (out[-1][-1] + event[-1],)
        else:
            out.append(event)
    return out


def collect(events) -> tuple[str | None, str | None, list[dict]]:
    """Events -> (reasoning_content, content, tool_calls) in the OpenAI message shape; an empty
    reasoning or content is None."""
    reasoning, content, calls = [], [], {}
    for event in events:
        if event[0] == "reasoning":
            reasoning.append(event[1])
        elif event[0] == "content":
            content.append(event[1])
        else:
            _, index, call_id, name, delta = event
            call = calls.setdefault(index, {"id": call_id, "type": "function",
                                            "function": {"name": name, "arguments": ""}})
            call["function"]["arguments"] += delta
    return "".join(reasoning) or None, "".join(content) or None, [calls[i] for i in sorted(calls)]


def parse_assistant(text: str, thinking: bool) -> tuple[str | None, str | None, list[dict]]:
    """The whole output at once: (reasoning_content, content, tool_calls)."""
    parser = AssistantParser(thinking)
    return collect(parser.feed(text) + parser.finish())
