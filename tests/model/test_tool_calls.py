"""Kimi tool declarations (TypeScript style) and the assistant-output parser.

- render_tools against declarations written out by hand from the reference encoder's rules
  (tool_declaration_ts.py of the K2.5 checkpoint), two of them as published by a Rust port's tests;
- render -> parse -> render: a conversation rendered by the real K2.5 chat_template.jinja (jinja2),
  its last assistant turn cut out as model output, parsed, put back and rendered again: the same text;
- the parser fed token by token through a Kimi tiktoken tokenizer (specials as single ids) and in
  random chunk sizes gives what parsing at once gives.
"""
import random
import shutil
import warnings

import pytest

from ddtree.model.chat_template import render_chat
from ddtree.model.tokenizer import ByteTokenizer, KimiTokenizer
from ddtree.model.tool_calls import AssistantParser, ToolSchemaError, collect, parse_assistant, render_tools
from tests.model.test_chat_template import K2T_TEMPLATE, K25_TEMPLATE, hf_render, write_byte_level_checkpoint

HEAD, TAIL = "# Tools\n\n## functions\nnamespace functions {\n", "\n}\n"


def fn(name, parameters=None, description=None):
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


OBJ = "object"
SEARCH = fn("search", description="Search the web.\n\nReturns results.", parameters={
    "type": OBJ, "required": ["query", "tags"], "properties": {
        "query": {"type": "string", "description": "What to look for", "minLength": 1, "maxLength": 200},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Filter tags", "maxItems": 5},
        "filters": {"type": OBJ, "description": "Extra filters", "required": ["lang"], "additionalProperties": False,
                    "properties": {"lang": {"type": "string", "enum": ["en", "fr"]},
                                   "safe": {"type": "boolean", "default": True}}},
        "sort": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "mode": {"type": ["string", "null"]},
        "points": {"type": "array", "items": {"type": OBJ, "description": "A point", "required": ["x", "y"],
                                              "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}})
SEARCH_TS = ("// Search the web.\n\n// Returns results.\n"
             "type search = (_: {\n"
             "  // What to look for\n  // maxLength: 200, minLength: 1\n  query: string,\n"
             "  // Filter tags\n  // maxItems: 5\n  tags: Array<string>,\n"
             "  // Extra filters\n  filters?: {\n    lang: \"en\" | \"fr\",\n    // Default: True\n"
             "    safe?: boolean,\n    [k: string]: never\n  },\n"
             "  // maximum: 50, minimum: 1\n  // Default: 10\n  limit?: number,\n"
             "  mode?: string | null,\n"
             "  points?: Array<\n    // A point\n    {\n      x: number,\n      y: number\n    }\n  >,\n"
             "  sort?: string | null\n"
             "}) => any;")
TREE = fn("tree_op", parameters={
    "type": OBJ, "required": ["root"],
    "$defs": {"Node": {"type": OBJ, "description": "A tree node", "required": ["value"], "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
    "properties": {"root": {"$ref": "#/$defs/Node", "description": "The root"}, "depth": {"type": "integer"}}})
TREE_TS = ("// A tree node\ninterface Node {\n  value: number,\n  children?: Array<Node>\n}\n"
           "type tree_op = (_: {\n  // The root\n  root: Node,\n  depth?: number\n}) => any;")
NEST = fn("nest", parameters={"type": OBJ, "required": ["name"],
                              "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}})
# the root as an interface: fields in (sorted) key order, not required-first
NEST_TS = "interface parameters {\n  child?: parameters,\n  name: string\n}\ntype nest = (_: parameters) => any;"
PING = fn("ping", description="Ping.")
LABELS = fn("labels", parameters={"type": OBJ, "additionalProperties": {"type": "string"}})

DECLARATIONS = {   # name: (tools, expected declaration)
    # published vectors (a Rust port's tests of the same encoder, checked against the Python one)
    "nested_object": ([fn("create_user", description="Create a new user record.", parameters={
        "type": OBJ, "required": ["user"], "properties": {"user": {
            "type": OBJ, "required": ["name"],
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}}})],
        HEAD + "// Create a new user record.\ntype create_user = (_: {\n  user: {\n    name: string,\n"
        "    age?: number\n  }\n}) => any;" + TAIL),
    "enum_and_description": ([fn("weather", description="Read weather", parameters={
        "type": OBJ, "required": ["city"], "properties": {
            "units": {"type": "string", "enum": ["c", "f"]},
            "city": {"type": "string", "description": "City name"}}})],
        HEAD + "// Read weather\ntype weather = (_: {\n  // City name\n  city: string,\n"
        "  units?: \"c\" | \"f\"\n}) => any;" + TAIL),
    "everything": ([SEARCH], HEAD + SEARCH_TS + TAIL),
    "defs": ([TREE], HEAD + TREE_TS + TAIL),
    "self_ref": ([NEST], HEAD + NEST_TS + TAIL),
    "no_parameters": ([PING], HEAD + "// Ping.\ntype ping = (_: {}) => any;" + TAIL),
    "additional_properties": ([LABELS], HEAD + "type labels = (_: {\n  [k: string]: string\n}) => any;" + TAIL),
    # a $defs entry pointing at the root: the root was already written inline, the def names it
    "late_self_ref": ([fn("f", parameters={"type": OBJ, "$defs": {"D": {"$ref": "#"}},
                                           "properties": {"a": {"type": "string"}}})],
                      HEAD + "interface D parameters\ntype f = (_: {\n  a?: string\n}) => any;" + TAIL),
    # several functions, one per block; a non-function tool skipped
    "several": ([PING, {"type": "retrieval"}, NEST],
                HEAD + "// Ping.\ntype ping = (_: {}) => any;\n" + NEST_TS + TAIL),
}


@pytest.mark.parametrize("case", sorted(DECLARATIONS))
def test_render_tools_matches_the_reference_encoder(case):
    tools, expected = DECLARATIONS[case]
    assert render_tools(tools) == expected


def test_render_tools_key_order_does_not_matter():
    reordered = [{"function": dict(reversed(list(SEARCH["function"].items()))), "type": "function"}]
    assert render_tools(reordered) == render_tools([SEARCH])
    assert render_tools([{"type": "retrieval"}]) == ""


@pytest.mark.parametrize("schema,match", [
    ({"oneOf": [{"type": "string"}]}, "unsupported JSON schema"),
    ({"$ref": "#/definitions/X"}, "only '#'"),
    ({"$ref": "#/$defs/Missing"}, "no such definition"),
    ({"type": "integer", "enum": ["a"]}, "not a integer"),
    ({"type": ["string", "date"]}, "date"),
])
def test_schemas_the_encoder_refuses_are_named(schema, match):
    with pytest.raises(ToolSchemaError, match=match):
        render_tools([fn("f", parameters={"type": OBJ, "properties": {"x": schema}})])


def test_tokenizer_declares_tools_as_the_k25_template_does(tmp_path):
    """Through the checkpoint's own template: K2.5's prints the TypeScript text, K2-Thinking's JSON;
    a schema the encoder refuses falls back to JSON with a warning, as the Kimi tokenizer does."""
    write_byte_level_checkpoint(tmp_path)
    messages = [{"role": "user", "content": "Find cats"}]
    tools = [SEARCH, TREE]
    shutil.copy(K25_TEMPLATE, tmp_path / "chat_template.jinja")
    tok = KimiTokenizer.from_dir(tmp_path)
    expected = hf_render(K25_TEMPLATE, messages, tools, tools_ts_str=render_tools(tools))
    assert expected.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n")
    assert tok.apply_chat_template(messages, tools=tools) == expected
    assert tok.decode(tok.encode_chat(messages, tools=tools)) == expected
    assert tok.apply_chat_template(messages, tools=tools, thinking=False) == hf_render(
        K25_TEMPLATE, messages, tools, tools_ts_str=render_tools(tools), thinking=False)
    bad = [fn("f", parameters={"type": OBJ, "properties": {"x": {"oneOf": []}}})]
    with pytest.warns(UserWarning, match="as JSON"):
        assert tok.apply_chat_template(messages, tools=bad) == hf_render(K25_TEMPLATE, messages, bad)
    shutil.copy(K2T_TEMPLATE, tmp_path / "chat_template.jinja")
    tok = KimiTokenizer.from_dir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tok.apply_chat_template(messages, tools=tools) == hf_render(K2T_TEMPLATE, messages, tools)
    # K2-Thinking's template has no thinking switch: `thinking` changes nothing, reasoning is kept
    loop = [*messages, {"role": "assistant", "reasoning_content": "r", "tool_calls": [call(0, "ping", "{}")]}]
    for thinking in (None, True, False):
        assert tok.apply_chat_template(loop, thinking=thinking) == hf_render(K2T_TEMPLATE, loop, thinking=thinking)
    assert ByteTokenizer().apply_chat_template(messages, tools=tools) == expected


# --- parsing the model's output ----------------------------------------------------------------------

def call(index, name, arguments):
    return {"id": f"functions.{name}:{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


ASSISTANT_TURNS = {   # the assistant message the model is to write (its reasoning, content, tool calls)
    "one_call": {"reasoning_content": "Need the search tool.", "content": "Let me look.",
                 "tool_calls": [call(0, "search", '{"query": "cats", "tags": ["pets"]}')]},
    "two_calls_no_content": {"reasoning_content": "Two lookups.\n<b>x</b> < y", "content": None, "tool_calls": [
        call(0, "search", '{"query": "日本語 ✓", "tags": []}'),
        call(1, "tree_op", '{"root": {"value": 1, "children": [{"value": 2}]}}')]},
    "plain_answer": {"reasoning_content": "Easy.", "content": "Cats are mammals.\n\n- purr\n- nap", "tool_calls": []},
    "no_reasoning": {"reasoning_content": None, "content": "Hi <|im_", "tool_calls": [call(0, "ping", "{}")]},
}
BEFORE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about cats"}]


def render_then_cut(turn: dict, thinking: bool):
    """(prompt, model output, full text): the full conversation rendered by the real template, the
    prompt being the same conversation up to the generation prompt."""
    tools = [SEARCH, TREE, PING]
    ts = render_tools(tools)
    message = {"role": "assistant", **{k: v for k, v in turn.items() if v}}
    prompt = hf_render(K25_TEMPLATE, BEFORE, tools, tools_ts_str=ts, thinking=thinking)
    full = hf_render(K25_TEMPLATE, BEFORE + [message], tools, add_generation_prompt=False,
                     tools_ts_str=ts, thinking=thinking)
    assert full.startswith(prompt)
    return tools, ts, full[len(prompt):], full


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("case", sorted(ASSISTANT_TURNS))
def test_render_parse_render_is_the_template(case, thinking):
    turn = ASSISTANT_TURNS[case]
    tools, ts, output, full = render_then_cut(turn, thinking)
    assert output.endswith("<|im_end|>")
    reasoning, content, tool_calls = parse_assistant(output, thinking)
    # the last assistant turn without tool calls is history: the template drops its reasoning
    assert reasoning == (turn["reasoning_content"] if thinking and turn["tool_calls"] else None)
    assert content == turn["content"]
    assert tool_calls == turn["tool_calls"]
    # None fields left out: the template would print a present None as "None"
    parsed = {"role": "assistant", **{k: v for k, v in [("content", content), ("reasoning_content", reasoning),
                                                         ("tool_calls", tool_calls)] if v is not None}}
    assert hf_render(K25_TEMPLATE, BEFORE + [parsed], tools, add_generation_prompt=False,
                     tools_ts_str=ts, thinking=thinking) == full
    assert ByteTokenizer().apply_chat_template(BEFORE + [parsed], tools=tools, add_generation_prompt=False,
                                               thinking=thinking) == full


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    n = write_byte_level_checkpoint(path)
    shutil.copy(K25_TEMPLATE, path / "chat_template.jinja")
    return KimiTokenizer.from_dir(path), n


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("case", sorted(ASSISTANT_TURNS))
def test_streaming_token_by_token_and_in_random_chunks(kimi_tokenizer, case, thinking):
    tok, n = kimi_tokenizer
    _, _, output, _ = render_then_cut(ASSISTANT_TURNS[case], thinking)
    ids = tok.encode(output)
    # the markers are single special ids (offsets as in the real table: 163584 + 11 ... + 15)
    if ASSISTANT_TURNS[case]["tool_calls"]:
        assert {n + 11, n + 12, n + 13, n + 14, n + 15} <= set(ids)
    assert ids[-1] == n + 2 and (n + 23 in ids) == thinking
    at_once = parse_assistant(output, thinking)
    parser, events = AssistantParser(thinking), []
    pieces = b""
    for i in ids:   # decode as a server does: bytes per token, text once the UTF-8 is whole
        pieces += tok.decode_bytes([i])
        try:
            text = pieces.decode("utf-8")
        except UnicodeDecodeError:
            continue
        pieces = b""
        events += parser.feed(text)
    assert pieces == b""
    assert collect(events + parser.finish()) == at_once
    rng = random.Random(hash((case, thinking)) % 1000)
    for _ in range(20):
        parser, events, at = AssistantParser(thinking), [], 0
        while at < len(output):
            size = rng.randint(1, 12)
            events += parser.feed(output[at:at + size])
            at += size
        assert collect(events + parser.finish()) == at_once


def test_events_stream_arguments_and_hold_back_split_markers():
    parser = AssistantParser(thinking=True)
    assert parser.feed("<thi") == []                 # maybe K2-Thinking's own <think>
    assert parser.feed("nk>plan</th") == [("reasoning", "plan")]
    assert parser.feed("ink>ok<|tool_calls_sec") == [("content", "ok")]
    assert parser.feed("tion_begin|><|tool_call_begin|> functions.get_weather:0 <|tool_call_arg") == []
    assert parser.feed('ument_begin|>{"city": "Par') == [
        ("tool_call", 0, "functions.get_weather:0", "get_weather", '{"city": "Par')]
    assert parser.feed('is"}<|tool_call_end|><|tool_call_begin|>functions.f:1<|tool_call_argument_begin|>') == [
        ("tool_call", 0, "functions.get_weather:0", "get_weather", 'is"}'), ("tool_call", 1, "functions.f:1", "f", "")]
    assert parser.feed("{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>ignored") == [
        ("tool_call", 1, "functions.f:1", "f", "{}")]
    assert parser.finish() == []


def test_cut_off_output():
    # generation stopped by its length: what arrived is kept, a call without arguments yet is dropped
    assert parse_assistant("still thinking <|tool", thinking=True) == ("still thinking <|tool", None, [])
    assert parse_assistant("a</think>b<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
                           thinking=True) == ("a", "b", [])
    assert parse_assistant('<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x', thinking=False) == (
        None, None, [call(0, "f", '{"x')])
    # thinking off: a </think> is ordinary content, but output opening with <think> (K2-Thinking,
    # whose prompt leaves it to the model) is reasoning; thinking on: a section ends the reasoning
    assert parse_assistant("<think>r</think>c", thinking=False) == ("r", "c", [])
    assert parse_assistant("<think>r</think>c", thinking=True) == ("r", "c", [])
    assert parse_assistant("c <think>", thinking=False) == (None, "c <think>", [])
    parser = AssistantParser(thinking=False)
    assert parser.feed("<") + parser.feed("thi") + parser.feed("nk>r</") == [("reasoning", "r")]
    assert parser.feed("think>c") + parser.finish() == [("content", "c")]
    assert parse_assistant("x</think>y", thinking=False) == (None, "x</think>y", [])
    assert parse_assistant("x<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                           "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
                           thinking=True) == ("x", None, [call(0, "f", "{}")])
    assert render_chat([{"role": "user", "content": "q"}], thinking=None) == render_chat(
        [{"role": "user", "content": "q"}])
