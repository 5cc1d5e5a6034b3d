"""Kimi chat rendering: a hand-written expected prompt, and the real chat_template.jinja files
(tests/fixtures/kimi/) rendered with jinja2 the way transformers renders chat templates."""
import base64
import copy
import functools
import json
import shutil
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment  # jinja2: a dev dependency

from ddtree.model.chat_template import KIMI_DEFAULT_SYSTEM, ChatFormatError, render_chat
from ddtree.model.tokenizer import ByteTokenizer, KimiTokenizer
from ddtree.model.tool_declaration import render_tools

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kimi"
K25_TEMPLATE = FIXTURES / "k2.5_chat_template.jinja"        # moonshotai/Kimi-K2.5 (via lightseekorg/smg)
K2T_TEMPLATE = FIXTURES / "k2-thinking_chat_template.jinja"  # moonshotai/Kimi-K2-Thinking (via llama.cpp)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": "The user greets me."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the weather tool.", "tool_calls": [CALL]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:0", "content": '{"temp_c": 18}'},
]


def test_multi_turn_tool_call_against_hand_written_prompt():
    expected = (
        "<|im_system|>tool_declare<|im_middle|>"
        '[{"function":{"description":"Current weather","name":"get_weather","parameters":'
        '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]'
        "<|im_end|>"
        "<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        # the last assistant turn without tool calls is history: its reasoning is dropped
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello! How can I help?<|im_end|>"
        "<|im_user|>user<|im_middle|>What's the weather in Paris?<|im_end|>"
        # the current tool-call loop keeps its reasoning
        "<|im_assistant|>assistant<|im_middle|><think>Need the weather tool.</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
        '{"temp_c": 18}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert render_chat(CONVERSATION, tools=TOOLS) == expected
    no_think = render_chat(CONVERSATION, tools=TOOLS, thinking=False)
    assert no_think == (expected.replace("<think>Need the weather tool.</think>", "<think></think>")
                        .removesuffix("<think>") + "<think></think>")


def test_default_system_prompt_goes_after_the_tool_declaration():
    got = render_chat([{"role": "user", "content": "Hi"}], tools=TOOLS, default_system=KIMI_DEFAULT_SYSTEM)
    assert got.startswith("<|im_system|>tool_declare<|im_middle|>[")
    assert ("<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
            "<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>") in got
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert KIMI_DEFAULT_SYSTEM not in render_chat(with_system, default_system=KIMI_DEFAULT_SYSTEM)


# --- the real templates, rendered like transformers' apply_chat_template ---------------------------

@functools.cache
def hf_template(template_path: Path):
    """transformers' chat-template environment: sandboxed, trim/lstrip blocks, loop controls, and a
    `tojson` that is json.dumps without HTML escaping."""
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    return env.from_string(template_path.read_text())


def hf_render(template_path: Path, messages, tools=None, add_generation_prompt=True, **kwargs) -> str:
    """The template rendered as the Kimi tokenizer's apply_chat_template does (tool keys sorted first)."""
    tools = json.loads(json.dumps(tools, sort_keys=True)) if tools else None
    return hf_template(template_path).render(messages=copy.deepcopy(messages), tools=tools,
                                             add_generation_prompt=add_generation_prompt, **kwargs)


CASES = {
    "tool_loop": CONVERSATION,
    "finished_tool_loop": CONVERSATION + [
        {"role": "assistant", "content": "It is 18 °C in Paris.", "reasoning_content": "Read the result."}],
    "no_system": [{"role": "user", "content": "你好"}],
    "empty": [],
    "named_user_and_parts": [
        {"role": "user", "name": "alice", "content": [{"type": "text", "text": "part one, "},
                                                      {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
    "two_calls_dict_args": [
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            CALL, {"id": "functions.get_weather:1", "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "°C"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "4"}],
    "assistant_last": [{"role": "user", "content": "Say hi"},
                       {"role": "assistant", "content": "Hi", "reasoning_content": "easy"}],
    "whitespace_and_markup": [{"role": "system", "content": "  line1\n\n  line2  "},
                              {"role": "user", "content": "\n<b>x</b> & 'y'\n"}],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_real_k25_template(case, tools, add_generation_prompt):
    messages = CASES[case]
    ours_on = render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    ours_off = render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, thinking=False)
    # thinking on is the template's default: the variable absent or true renders the same
    assert ours_on == hf_render(K25_TEMPLATE, messages, tools, add_generation_prompt)
    assert ours_on == hf_render(K25_TEMPLATE, messages, tools, add_generation_prompt, thinking=True)
    assert ours_off == hf_render(K25_TEMPLATE, messages, tools, add_generation_prompt, thinking=False)


def test_tools_ts_str_replaces_the_json_declaration():
    ts = "# Tools\n\n## functions\nnamespace functions {\ntype ping = (_: {}) => any;\n}\n"
    messages = CASES["no_system"]
    assert (render_chat(messages, tools=TOOLS, tools_ts_str=ts)
            == hf_render(K25_TEMPLATE, messages, TOOLS, tools_ts_str=ts))


@pytest.mark.parametrize("case", ["tool_loop", "finished_tool_loop", "no_system", "empty", "assistant_last"])
def test_default_system_matches_real_k2_thinking_template(case):
    """K2-Thinking injects the default system prompt; it has no thinking switch (reasoning always
    kept in the suffix) and no <think> in the generation prompt."""
    messages = CASES[case]
    ours = render_chat(messages, default_system=KIMI_DEFAULT_SYSTEM, add_generation_prompt=False)
    assert ours == hf_render(K2T_TEMPLATE, messages, add_generation_prompt=False)
    ours_gen = render_chat(messages, default_system=KIMI_DEFAULT_SYSTEM)
    assert ours_gen.removesuffix("<think>") == hf_render(K2T_TEMPLATE, messages)


def write_byte_level_checkpoint(path: Path) -> int:
    """tiktoken.model with the 256 single bytes; specials named at offsets as in the real table."""
    path.joinpath("tiktoken.model").write_text("".join(
        f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    names = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
             11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
             14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 22: "<think>",
             23: "</think>"}
    decoder = {str(256 + k): {"content": v} for k, v in names.items()}
    path.joinpath("tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return 256


def test_tokenizer_reads_default_system_from_checkpoint_template(tmp_path):
    n = write_byte_level_checkpoint(tmp_path)
    shutil.copy(K25_TEMPLATE, tmp_path / "chat_template.jinja")
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.default_system is None
    messages = CASES["no_system"]
    assert tok.apply_chat_template(messages) == hf_render(K25_TEMPLATE, messages)
    shutil.copy(K2T_TEMPLATE, tmp_path / "chat_template.jinja")
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.default_system == KIMI_DEFAULT_SYSTEM
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == hf_render(
        K2T_TEMPLATE, messages, add_generation_prompt=False)
    # encode_chat: each marker is one special id, and no [BOS]
    ids = tok.encode_chat(CONVERSATION)
    assert ids[0] == n + 10 and n not in ids                       # <|im_system|> first
    assert ids.count(n + 2) == len(CONVERSATION)                   # one <|im_end|> per turn
    assert ids[-1] == n + 17                                       # ...<|im_middle|>: K2-Thinking's model opens <think>
    assert tok.apply_chat_template(CONVERSATION) == hf_render(K2T_TEMPLATE, CONVERSATION)
    assert tok.decode(ids) == tok.apply_chat_template(CONVERSATION)


def test_byte_tokenizer_renders_the_same_text():
    tok = ByteTokenizer()
    text = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    # the tiny models follow K2.6: tools declared in TypeScript style (tests/model/test_tool_calls.py)
    assert text == render_chat(CONVERSATION, tools=TOOLS, tools_ts_str=render_tools(TOOLS))
    assert tok.encode_chat(CONVERSATION, tools=TOOLS) == list(text.encode())


@pytest.mark.parametrize("messages,match", [
    ([{"role": "tool", "content": "x"}], "tool_call_id"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "text-only"),
    ([{"content": "no role"}], "role"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], "tool_calls\\[0\\]"),
])
def test_bad_messages_are_named(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        render_chat(messages)
