"""OpenAI `tools` -> the TypeScript-style declaration Kimi K2.5 / K2.6 are prompted with.

Kimi K2.5+ checkpoints ship `tool_declaration_ts.py` beside `tokenization_kimi.py`; the tokenizer's
`apply_chat_template` deep-sorts the tools' keys, runs `encode_tools_to_typescript_style` on them
and hands the text to `chat_template.jinja` as `tools_ts_str` (the template prints it verbatim in the
`tool_declare` turn). When the encoder raises, the tokenizer prints the error and the template falls
back to compact JSON. This module re-implements that encoder; its output is interoperability data
(what the model was trained on), so every space, comment marker and Python `str()`/`repr()` of a
value below follows the reference byte for byte. Read from the copies of `tool_declaration_ts.py`
vendored by thinking-machines-lab/tinker-cookbook (renderers/kimi_k2_5_tool_declaration_ts.py) and
sgl-project/sglang; tests/model/test_tool_calls.py checks hand-derived outputs.

The output, for tools [get_weather(city: string, unit?: "c" | "f")]:

    # Tools

    ## functions
    namespace functions {
    // Current weather            <- the function's description, one `// ` line per line
    type get_weather = (_: {
      city: string,               <- required fields first, then optional (`?`), each group by name
      unit?: "c" | "f"
    }) => any;
    }

Schema parts handled: object (properties / required / additionalProperties -> `[k: string]: T`),
array (`Array<T>`), enum (`"a" | 1`), anyOf, `type: [..]` unions, `$ref` to `#/$defs/NAME`
(-> `interface NAME {...}` before the type) or to `#` (the parameters themselves, -> `interface
parameters`), scalars (integer -> number), descriptions and a few constraints as `//` comments.
Anything else is a ToolSchemaError.
"""
from __future__ import annotations

import json

from ddtree.errors import InputError

INDENT = "  "
FIELD_SEP = ",\n"
# the only constraints the reference prints, per JSON-schema type
CONSTRAINT_KEYS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                   "integer": ("maximum", "minimum"), "array": ("minItems", "maxItems")}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean",
               "null": "null", "object": "{}", "array": "Array<any>"}


class ToolSchemaError(InputError):
    """A tool's JSON schema the Kimi TypeScript declaration cannot express."""


def render_tools(tools: list[dict]) -> str:
    """The declaration text (`tools_ts_str`) for an OpenAI `tools` list; "" when it holds no function."""
    try:
        functions = [_render_function(tool["function"]) for tool in _deep_sorted(tools)
                     if tool.get("type") == "function" and tool.get("function")]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ToolSchemaError(f"tools: cannot be declared in Kimi's TypeScript style: "
                              f"{type(e).__name__}: {e}") from e
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def comment(text: str, indent: str = "") -> str:
    """Each line as `indent// line`; empty lines stay empty (no indent, no //)."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


# --- parse: a JSON schema -> a tree of nodes ---------------------------------------------------------
# Parsing finishes before anything is rendered because `$defs` are registered as their object is
# parsed (in property order) and a `$ref` must find its target registered by then.

class Defs:
    """The `$defs` seen so far (name -> schema) and whether `$ref: "#"` occurred."""

    def __init__(self):
        self.schemas: dict[str, dict] = {}
        self.self_ref = False


class Node:
    """One schema. kind: scalar | object | array | enum | anyof | union | ref."""

    def __init__(self, kind: str, schema: dict, constraint_type: str | None = None, **parts):
        self.kind = kind
        self.description = schema.get("description", "")
        keys = CONSTRAINT_KEYS.get(constraint_type, ())
        self.constraints = {k: v for k, v in schema.items() if k in keys}
        self.__dict__.update(parts)

    def docstring(self, indent: str) -> str:
        """The `//` lines printed above a field or array item, each ending in a newline."""
        lines = [comment(self.description, indent)] if self.description else []
        if self.constraints:
            lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items())))
        return "".join(line + "\n" for line in lines)


class Field:
    def __init__(self, name: str, node: Node, optional: bool, default):
        self.name, self.node, self.optional, self.default = name, node, optional, default


def parse(schema, defs: Defs) -> Node:
    if isinstance(schema, bool):   # true: anything; false: the reference prints null (and warns)
        return Node("scalar", {}, name="any" if schema else "null")
    if "$ref" in schema:
        return _parse_ref(schema, defs)
    if "anyOf" in schema:
        return Node("anyof", schema, members=[parse(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        _check_enum(schema)
        return Node("enum", schema, values=schema["enum"])
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            return Node("union", schema, names=[UNION_NAMES[t] for t in kind])
        if kind == "object":
            return parse_object(schema, defs)
        if kind == "array":
            item = parse(schema["items"], defs) if schema.get("items") else Node("scalar", {}, name="any")
            return Node("array", schema, "array", item=item)
        return Node("scalar", schema, kind, name=kind)
    if schema == {}:
        return Node("scalar", {}, name="any")
    raise ValueError(f"unsupported JSON schema {json.dumps(schema, ensure_ascii=False)}")


def parse_object(schema: dict, defs: Defs) -> Node:
    """Any dict as an object (the parameters are parsed this way whatever their 'type')."""
    node = Node("object", schema, fields=[], extra=None)
    if not schema:
        return node
    defs.schemas.update(schema.get("$defs") or {})
    extra = schema.get("additionalProperties")
    node.extra = parse(extra, defs) if isinstance(extra, dict) else extra
    if "properties" not in schema:
        return node
    properties = schema["properties"]
    required = set(schema.get("required", []))
    node.fields = [Field(name, parse(prop, defs), name not in required,
                         prop.get("default") if isinstance(prop, dict) else None)
                   for name, prop in properties.items()]
    return node


def _parse_ref(schema: dict, defs: Defs) -> Node:
    ref = schema["$ref"]
    if ref == "#":
        defs.self_ref = True
        return Node("ref", schema, name="parameters")
    if not ref.startswith("#/$defs/"):
        raise ValueError(f"unsupported $ref {ref!r} (only '#' and '#/$defs/NAME')")
    name = ref.split("/")[-1]
    if name not in defs.schemas:
        raise ValueError(f"$ref {ref!r}: no such definition (yet) in $defs")
    return Node("ref", schema, name=name)


def _check_enum(schema: dict) -> None:
    """The reference refuses enum values that contradict a declared type (null always allowed)."""
    if "type" not in schema:
        return
    kind = schema["type"]
    if isinstance(kind, list):
        if len(kind) == 1:
            kind = kind[0]
        elif len(kind) == 2 and "null" in kind:
            kind = kind[0] if kind[0] != "null" else kind[1]
        else:
            raise ValueError(f"enum type {kind} is not supported")
    wanted = {"string": str, "number": (int, float), "integer": int, "boolean": bool}.get(kind)
    for value in schema["enum"]:
        if value is not None and wanted is not None and not isinstance(value, wanted):
            raise ValueError(f"enum value {value} is not a {kind}")


# --- render -----------------------------------------------------------------------------------------

def type_text(node: Node, indent: str = "") -> str:
    """The TypeScript type of `node`; nested objects are indented one level per depth."""
    if node.kind == "scalar":
        return "number" if node.name == "integer" else node.name
    if node.kind == "object":
        return _object_text(node, indent)
    if node.kind == "array":
        inner = indent + INDENT
        doc = node.item.docstring(inner)
        if doc:
            return "Array<\n" + doc + inner + type_text(node.item, inner) + "\n" + indent + ">"
        return f"Array<{type_text(node.item, indent)}>"
    if node.kind == "enum":   # strings in double quotes as they are (no escaping); others Python str()
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in node.values)
    if node.kind == "anyof":
        return " | ".join(type_text(m, indent) for m in node.members)
    if node.kind == "union":
        return " | ".join(node.names)
    return node.name   # ref


def field_text(field: Field, indent: str) -> str:
    """`// docs` lines, `// Default: ...`, then `name?: type` (no trailing separator)."""
    text = field.node.docstring(indent)
    if field.default is not None:
        # numbers and booleans as Python repr (True, 1.5); everything else as JSON
        shown = repr(field.default) if isinstance(field.default, (int, float, bool)) else json.dumps(
            field.default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{field.name}{'?' if field.optional else ''}: {type_text(field.node, indent)}"


def _object_text(node: Node, indent: str) -> str:
    inner = indent + INDENT
    ordered = (sorted((f for f in node.fields if not f.optional), key=lambda f: f.name)
               + sorted((f for f in node.fields if f.optional), key=lambda f: f.name))
    lines = [field_text(f, inner) for f in ordered]
    if node.extra is not None:
        if node.extra is True:
            extra = "any"
        elif node.extra is False:
            extra = "never"
        elif isinstance(node.extra, Node):
            extra = type_text(node.extra, inner)
        else:
            raise ValueError(f"unknown additionalProperties: {node.extra}")
        lines.append(f"{inner}[k: string]: {extra}")
    if not lines:
        return "{}"
    return "{\n" + FIELD_SEP.join(lines) + "\n" + indent + "}"


def _render_function(function: dict) -> str:
    """[interface ... lines,] [// description,] type NAME = (_: {...}) => any;"""
    defs = Defs()
    parameters = parse_object(function.get("parameters") or {}, defs)
    interfaces = []
    root_is_interface = defs.self_ref   # decided before the $defs are parsed (they may add a `$ref: "#"`)
    if root_is_interface:
        # the root as `interface parameters`: fields in property order, no additionalProperties
        body = FIELD_SEP.join(field_text(f, INDENT) for f in parameters.fields)
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in list(defs.schemas.items()):   # defs registered while rendering these are not printed
        body = type_text(parse(schema, defs))
        description = schema.get("description", "")
        interfaces.append((comment(description) + "\n" if description else "") + f"interface {name} {body}")
    signature = "parameters" if root_is_interface else type_text(parameters)
    name = function.get("name", "function")
    description = function.get("description")
    parts = ["\n".join(interfaces), comment(description) if description else "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(p for p in parts if p)


def _deep_sorted(value):
    """Dict keys sorted at every depth, as the Kimi tokenizer sorts `tools` before encoding."""
    if isinstance(value, dict):
        return {k: _deep_sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_deep_sorted(v) for v in value]
    return value
