"""The checkpoint's own chat template, rendered with jinja2 the way transformers' apply_chat_template does.

    template = ChatTemplate(text, source="…/chat_template.jinja")      # compiled once
    template.render(messages, tools=None, add_generation_prompt=True, **kwargs) -> str

The environment is transformers' (`transformers.utils.chat_template_utils._compile_jinja_template`): an
`ImmutableSandboxedEnvironment` (a template cannot reach Python internals nor mutate its inputs) with
trim_blocks, lstrip_blocks and loop controls; `tojson` is json.dumps without HTML escaping (ensure_ascii off);
the globals `raise_exception(message)` and `strftime_now(format)`. Kimi's tokenizer wrapper
(tokenization_kimi.py) sorts the keys of `tools` at every depth before rendering and passes `tools_ts_str`
(the TypeScript declaration); tokenizer.chat_text does both. Template variables the caller leaves None are
not passed at all (undefined in the template: its own default, e.g. Kimi's `thinking` on).

Where the template comes from (tokenizer.py): `--chat-template FILE`, else the checkpoint's
chat_template.jinja, else tokenizer_config.json "chat_template" (a string; a list of named templates uses
"default"). A checkpoint without any (the embedded tiny models) renders with model/chat_template.py, the
hand port of Kimi K2.5 / K2.6, byte-identical to this on every fixture (tests/model/test_jinja_template.py).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path

from ddtree.model.chat_template import ChatFormatError


class ChatTemplateError(ChatFormatError):
    """A chat template that does not compile, or fails while rendering (its own raise_exception included)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError  # jinja2: the serve extra
    raise TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, text: str, source: str = "chat template"):
        try:
            import jinja2  # jinja2: the serve extra
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # jinja2: the serve extra
        except ImportError as e:
            raise ChatTemplateError(f"{source}: rendering a chat template needs jinja2 (the 'serve' extra: "
                                    "pip install 'ddtree[serve]')") from e
        self.text, self.source = text, source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{source}: not a valid jinja2 template (line {e.lineno}: {e.message})") from None
        self._errors = (jinja2.TemplateError,)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        variables = {k: v for k, v in kwargs.items() if v is not None}
        try:
            return self.template.render(messages=copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                        add_generation_prompt=add_generation_prompt, **variables)
        except self._errors as e:
            raise ChatTemplateError(f"{self.source}: rendering failed: {type(e).__name__}: {e}") from None


def read_chat_template(path) -> ChatTemplate:
    """--chat-template FILE -> the compiled template (a missing or unreadable file names itself)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"--chat-template {path}: cannot read it ({e})") from None
    return ChatTemplate(text, str(path))
