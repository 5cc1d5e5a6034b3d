"""The checkpoint's own chat template rendered with jinja2 (model/jinja_template.py): byte-identical to the hand
port (model/chat_template.py) on every fixture case, K2.5 / K2.6 (the tools_ts_str declaration) and
K2-Thinking, thinking default / on / off, tools or not; the checkpoint's file is what renders (an edited
template shows), and the environment is sandboxed."""
import copy
import json
import shutil

import pytest

from ddtree.model.jinja_template import ChatTemplate, ChatTemplateError, read_chat_template
from ddtree.model.tokenizer import ByteTokenizer, KimiTokenizer, use_chat_template
from tests.model.test_chat_template import (
    CASES,
    CONVERSATION,
    K2T_TEMPLATE,
    K25_TEMPLATE,
    TOOLS,
    write_byte_level_checkpoint,
)


def tokenizers(tmp_path, template_path):
    """(jinja-rendering tokenizer, the same tokenizer rendering with the hand port)."""
    write_byte_level_checkpoint(tmp_path)
    shutil.copy(template_path, tmp_path / "chat_template.jinja")
    jinja = KimiTokenizer.from_dir(tmp_path)
    assert isinstance(jinja.chat_template, ChatTemplate)
    hand = KimiTokenizer.from_dir(tmp_path)
    hand.chat_template = None
    return jinja, hand


@pytest.mark.parametrize("template", [K25_TEMPLATE, K2T_TEMPLATE], ids=["k2.5", "k2-thinking"])
def test_jinja_equals_the_hand_port_on_every_case(tmp_path, template):
    jinja, hand = tokenizers(tmp_path, template)
    n = 0
    for case, messages in CASES.items():
        for tools in (None, TOOLS):
            for gen in (True, False):
                for thinking in (None, True, False):
                    before = copy.deepcopy(messages)
                    got = jinja.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, thinking=thinking)
                    want = hand.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, thinking=thinking)
                    assert got == want, (case, tools is not None, gen, thinking)
                    assert messages == before                    # the template saw copies
                    n += 1
    assert n == len(CASES) * 12


def test_k26_tools_declared_as_typescript(tmp_path):
    """K2.6 declares tools through tools_ts_str, which the K2.5 template prints; the tool keys sorted."""
    jinja, hand = tokenizers(tmp_path, K25_TEMPLATE)
    shuffled = json.loads(json.dumps(TOOLS))
    shuffled[0]["function"] = dict(reversed(list(shuffled[0]["function"].items())))
    text = jinja.apply_chat_template(CONVERSATION, tools=shuffled)
    assert text == hand.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert "namespace functions" in text


def test_the_checkpoint_template_is_what_renders(tmp_path):
    write_byte_level_checkpoint(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("CUSTOM{% for m in messages %}[{{ m['role'] }}]{% endfor %}"
                                                  "{% if add_generation_prompt %}>{% endif %}")
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "CUSTOM[user]>"
    # tokenizer_config.json's "chat_template", transformers' list form: the one named "default"
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 + 1 }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert KimiTokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "D2"


def test_chat_template_file_overrides(tmp_path):
    """--chat-template FILE on a tokenizer without a template (the tiny models' ByteTokenizer)."""
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] | upper }}{% if tools %}{{ tools | tojson }}{% endif %}")
    tok = ByteTokenizer()
    plain = tok.encode_chat([{"role": "user", "content": "hi"}])
    use_chat_template(tok, path.read_text(), str(path))
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == list(b"HI")
    assert plain != list(b"HI")
    assert ByteTokenizer().chat_template is None                 # an instance attribute, not the class's


@pytest.mark.parametrize("text,match", [
    ("{{ messages.append(1) }}", "SecurityError"),                         # inputs are immutable
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "SecurityError|UndefinedError"),
    ("{{ raise_exception('only user turns') }}", "only user turns"),
])
def test_sandbox_and_errors(text, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(text, "t.jinja").render([{"role": "user", "content": "x"}])


def test_bad_template_files_are_named(tmp_path):
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatTemplate("{% if %}", "bad.jinja")
    with pytest.raises(ChatTemplateError, match="--chat-template .*missing.jinja"):
        read_chat_template(tmp_path / "missing.jinja")
