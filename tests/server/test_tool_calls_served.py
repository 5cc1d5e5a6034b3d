"""A tool call end to end: a SCRIPTED EXECUTOR (declared as such: the tiny model never calls tools)
makes the target's logits pick a fixed Kimi-format answer, driven through the real DDTree decode loop
(the real drafter drafts, the real tree is verified and walked), served by the real app, parsed by the
official openai client, streamed and not."""
from __future__ import annotations

import numpy as np
import openai
import pytest

from ddtree.runtime.engine import DDTreeEngine
from ddtree.server.app import create_app
from tests.server.conftest import MODEL, in_process_server

ANSWER = ("I should look it up.</think>Checking the weather.<|tool_calls_section_begin|><|tool_call_begin|>"
          "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
          "<|tool_calls_section_end|><|im_end|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


class ScriptedExecutor:
    """The real executor, except that the target's logits put the scripted token first at every position
    past the prompt (then EOS): greedy decoding commits exactly the script, whatever the tree."""

    def __init__(self, executor, script: list[int], eos: int):
        self.executor, self.script, self.eos = executor, script, eos
        self.prompt_len = None

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def target_forward(self, ids, pos, visible, cache, taps=()):
        if int(pos[0]) == 0:                                  # the prefill: remember where the answer starts
            self.prompt_len = len(ids)
        logits, tapped = self.executor.target_forward(ids, pos, visible, cache, taps)
        logits = logits.copy()
        for row, p in enumerate(np.asarray(pos)):
            k = int(p) + 1 - self.prompt_len                  # the answer's index of the token after p
            logits[row, self.script[k] if 0 <= k < len(self.script) else self.eos] += 1e6
        return logits, tapped


@pytest.fixture(scope="module")
def client():
    real = DDTreeEngine.load()
    script = real.tokenizer.encode(ANSWER)
    scripted = ScriptedExecutor(real.executor, script, real.tokenizer.eos_id)
    engine = DDTreeEngine(scripted, real.tokenizer, real.model_dir, real.drafter_dir)
    with in_process_server(create_app(engine, MODEL)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                          tools=TOOLS, max_tokens=400, temperature=0, **kw)


def test_tool_call_parsed_by_the_openai_client(client):
    r = ask(client)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking the weather."
    assert choice.message.model_extra["reasoning_content"] == "I should look it up."
    [call] = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("functions.get_weather:0", "function", "get_weather")
    assert call.function.arguments == '{"city": "Paris"}'
    assert r.usage.model_dump()["ddtree"]["steps"] >= 1


def test_tool_call_streamed_as_deltas(client):
    reasoning, content, calls, finishes = "", "", {}, []
    for chunk in ask(client, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or part.id
            call["name"] = call["name"] or (part.function.name if part.function else None)
            call["arguments"] += (part.function.arguments or "") if part.function else ""
        finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (reasoning, content) == ("I should look it up.", "Checking the weather.")
    assert calls == {0: {"id": "functions.get_weather:0", "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert finishes == ["tool_calls"]
