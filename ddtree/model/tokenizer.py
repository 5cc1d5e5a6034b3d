"""Tokenizers: the Kimi K2.x tiktoken BPE and the byte tokenizer of the tiny test models.

Both have one interface:
    encode(text, allow_special=True) -> list[int]   special-token text -> one id each when allowed
    decode(ids) -> str                              specials kept as their text; bad UTF-8 -> U+FFFD
    decode_bytes(ids) -> bytes                      exact bytes (decode per token can split a character)
    apply_chat_template(messages, tools=None, add_generation_prompt=True, thinking=None) -> str
    encode_chat(messages, tools=None, add_generation_prompt=True, thinking=None) -> list[int]
                                                    the rendered prompt, specials as ids, no [BOS];
                                                    thinking None: the template's default (on)
    vocab_size, bos_id, eos_id, pad_id, stop_ids, special_tokens {name: id}

`load_tokenizer(model_dir, config)` picks one from the checkpoint's config.json.

Kimi (docs/kimi-k2.md section 7): the checkpoint ships `tiktoken.model` (base64 token + rank per line,
163,584 ranks), `tokenizer_config.json` (added_tokens_decoder names the 256 ids after the ranks)
and `chat_template.jinja`. Pre-tokenisation uses Kimi's split regex; it needs Unicode script
classes and class intersection, which Python `re` lacks, so it goes straight to tiktoken (Rust
fancy-regex), as the reference tokenizer does.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from ddtree.errors import InputError
from ddtree.model.chat_template import KIMI_DEFAULT_SYSTEM, _deep_sorted, render_chat
from ddtree.model.jinja_template import ChatTemplate
from ddtree.model.presets import BYTE_BOS, BYTE_EOS, BYTE_MASK, BYTE_PAD
from ddtree.model.tool_declaration import ToolSchemaError, render_tools

# --- interoperability constants (byte-exact) -----------------------------------------------------
# TikTokenTokenizer.pat_str of moonshotai Kimi-K2 tokenization_kimi.py (identical in K2-Thinking,
# K2.5 and K2.6 per smg-project/smg PR #1482). Read from the copies PabloRaka/bear
# tokenization_kimi.py and troy12x/quasar-kimi tokenization_kimi.py, which agree with each other
# and with lightseekorg/smg crates/tokenizer/src (TIKTOKEN_PATTERN_KIMI).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_SPECIAL = 256                    # num_reserved_special_tokens: ids n_ranks .. n_ranks + 255
TIKTOKEN_MAX_ENCODE_CHARS = 400_000  # tiktoken handles <= 400k chars per call without a panic
MAX_NO_WHITESPACES_CHARS = 25_000    # longest whitespace / non-whitespace run per call (openai/tiktoken#195)


def reserved_name(token_id: int) -> str:
    """Name of a special id that tokenizer_config.json does not name (tokenization_kimi.py)."""
    return f"<|reserved_token_{token_id}|>"


# Used only when a checkpoint has no added_tokens_decoder: offsets from the first special id
# (163,584 in the real checkpoints). From docs/kimi-k2.md section 7 (K2 tool-call format doc,
# hf-model-inspector, tinker-cookbook PR #784); its [inferred] rows are left out.
FALLBACK_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}


class TokenizerError(InputError):
    """A tokenizer file or token id that cannot be used."""


# --- input splitting -------------------------------------------------------------------------------

def split_long_runs(text: str, max_run: int) -> list[str]:
    """Cut `text` so that no piece holds more than `max_run` consecutive whitespace or consecutive
    non-whitespace characters: a cut falls on the (max_run+1)-th, (2 max_run+1)-th ... character of
    every such run. Pieces concatenate back to `text`."""
    pieces, start, run, run_is_space = [], 0, 0, None
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if is_space != run_is_space:
            run_is_space, run = is_space, 1
            continue
        run += 1
        if run > max_run:
            pieces.append(text[start:i])
            start, run = i, 1
    pieces.append(text[start:])
    return pieces


def split_for_tiktoken(text: str, max_chars: int = TIKTOKEN_MAX_ENCODE_CHARS,
                       max_run: int = MAX_NO_WHITESPACES_CHARS) -> list[str]:
    """Windows of `max_chars` characters, each cut further by `split_long_runs` (runs restart per window)."""
    return [piece for start in range(0, len(text), max_chars)
            for piece in split_long_runs(text[start:start + max_chars], max_run)]


# --- Kimi ------------------------------------------------------------------------------------------

class KimiTokenizer:
    """Kimi K2.x BPE: `mergeable_ranks` {token bytes: rank 0..n-1} plus 256 special ids after them."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_names: dict[int, str],
                 default_system: str | None = None, source: str = "tiktoken.model",
                 tools_as_typescript: bool = True, tools_json_spaced: bool = False, thinking_switch: bool = True):

        n_ranks = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(n_ranks)):
            raise TokenizerError(f"{source}: ranks must be exactly 0..{n_ranks - 1} (one per line, no gaps)")
        if sorted(special_names) != list(range(n_ranks, n_ranks + NUM_SPECIAL)):
            raise TokenizerError(f"{source}: expected special ids {n_ranks}..{n_ranks + NUM_SPECIAL - 1}")
        self.special_tokens = {name: i for i, name in special_names.items()}   # {name: id}
        if len(self.special_tokens) != NUM_SPECIAL:
            raise TokenizerError(f"{source}: special token names are not unique")
        self.id_to_special = dict(special_names)
        self.encoding = tiktoken.Encoding(name=Path(source).name, pat_str=KIMI_PAT_STR,
                                          mergeable_ranks=mergeable_ranks, special_tokens=self.special_tokens)
        self.vocab_size = n_ranks + NUM_SPECIAL
        self.default_system = default_system
        self.tools_as_typescript = tools_as_typescript   # K2.5+: tools declared via tools_ts_str
        self.tools_json_spaced = tools_json_spaced       # K2-Thinking: `tools | tojson()`, ", " and ": "
        self.thinking_switch = thinking_switch           # False (K2-Thinking): no `thinking` variable
        self.chat_template = None                        # jinja_template.ChatTemplate: the checkpoint's own
        self.bos_id = self._required("[BOS]", source)
        self.eos_id = self._required("[EOS]", source)
        self.im_end_id = self._required("<|im_end|>", source)
        self.pad_id = self.special_tokens.get("[PAD]")
        self.stop_ids = frozenset({self.eos_id, self.im_end_id})   # chat turns end with <|im_end|>

    def _required(self, name: str, source: str) -> int:
        if name not in self.special_tokens:
            raise TokenizerError(f"{source}: special token {name!r} is not among the named specials "
                                 "(tokenizer_config.json added_tokens_decoder)")
        return self.special_tokens[name]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "KimiTokenizer":
        """Load tiktoken.model, name the specials from tokenizer_config.json, and read
        chat_template.jinja to learn whether this checkpoint injects the default system prompt."""

        model_dir = Path(model_dir)
        bpe_path = model_dir / "tiktoken.model"
        if not bpe_path.is_file():
            raise TokenizerError(f"{bpe_path}: missing; a Kimi checkpoint needs tiktoken.model "
                                 "(or config.json \"ddtree_tokenizer\": \"bytes\" for a byte-level model)")
        try:
            ranks = load_tiktoken_bpe(str(bpe_path))
        except Exception as e:  # noqa: BLE001 - re-raised with the file named
            raise TokenizerError(f"{bpe_path}: not a tiktoken BPE file (base64 token, space, rank per line): {e}")
        config_path = model_dir / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        names = special_names(len(ranks), tok_config.get("added_tokens_decoder"), where=str(config_path))
        template, where = _chat_template_text(model_dir, tok_config)
        tok = cls(ranks, names, source=str(bpe_path), **template_traits(template))
        if template is not None:
            use_chat_template(tok, template, where)
        return tok

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode: expected str, got {type(text).__name__}")
        ids: list[int] = []
        for piece in split_for_tiktoken(text):
            if allow_special:
                ids += self.encoding.encode(piece, allowed_special="all")
            else:   # special-token text is ordinary text
                ids += self.encoding.encode(piece, disallowed_special=())
        return ids

    def decode_bytes(self, ids) -> bytes:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary 0..{self.vocab_size - 1}")
        return self.encoding.decode_bytes(ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, thinking=None,
                            tools_ts_str: str | None = None) -> str:
        return chat_text(self, messages, tools, add_generation_prompt, thinking, tools_ts_str)

    def encode_chat(self, messages, tools=None, add_generation_prompt=True, thinking=None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, thinking))


def template_traits(template: str | None) -> dict:
    """What the hand port and the tools declaration need to know of a Kimi template's text."""
    return dict(
        default_system=KIMI_DEFAULT_SYSTEM if template and KIMI_DEFAULT_SYSTEM in template else None,
        # K2.5+ templates print `tools_ts_str` (their tokenizer's TypeScript declaration) and fall back
        # to compact JSON; K2-Thinking's has no such variable and prints `tools | tojson()` (spaced).
        # No template: the newest format.
        tools_as_typescript=template is None or "tools_ts_str" in template,
        tools_json_spaced=template is not None and "tojson(separators" not in template,
        # K2.5+ read `thinking` (default on); K2-Thinking's template has no such switch
        thinking_switch=template is None or "thinking" in template)


def use_chat_template(tok, template: str, source: str) -> None:
    """Render tok's chat prompts with `template` (jinja2, sandboxed: jinja_template.py); --chat-template and
    the checkpoint's own template come here. Without jinja2 installed (the base install), the checkpoint's
    template is rendered by the hand port, which equals it on Kimi K2.5 / K2.6 / K2-Thinking, with a warning."""
    for key, value in template_traits(template).items():
        setattr(tok, key, value)
    try:
        import jinja2  # noqa: F401
    except ImportError:
        warnings.warn(f"{source}: jinja2 is not installed (the 'serve' extra); rendering chat prompts with the "
                      "built-in Kimi K2.x port instead of the checkpoint's template", stacklevel=2)
        return
    tok.chat_template = ChatTemplate(template, source)


def chat_text(tok, messages, tools=None, add_generation_prompt=True, thinking=None,
              tools_ts_str: str | None = None) -> str:
    """The prompt text as the checkpoint's own tokenizer + template render it: thinking None is the
    template's default (on; a template without the switch ignores it); with tools_as_typescript the tools are declared in TypeScript style
    (tool_declaration.py). Where that encoder fails on a schema the Kimi tokenizer falls back to
    the template's JSON declaration, and so do we, with a warning naming the schema problem.
    With a jinja template (tok.chat_template) the messages are first checked by the hand port's rules (a
    tool turn needs its tool_call_id, text-only parts, ...), then the template renders them, the tools
    key-sorted at every depth as Kimi's tokenizer passes them."""
    if tools and tools_ts_str is None and tok.tools_as_typescript:
        try:
            tools_ts_str = render_tools(tools) or None
        except ToolSchemaError as e:
            warnings.warn(f"{e}; declaring the tools as JSON instead, as the Kimi tokenizer does", stacklevel=3)
    template = getattr(tok, "chat_template", None)
    if template is not None:
        render_chat(messages, add_generation_prompt=False)           # the checks only (ChatFormatError)
        return template.render(messages, tools=_deep_sorted(tools) if tools else None,
                               add_generation_prompt=add_generation_prompt, tools_ts_str=tools_ts_str,
                               thinking=thinking)
    if tools and tools_ts_str is None and tok.tools_json_spaced:
        tools_ts_str = json.dumps(tools, ensure_ascii=False, sort_keys=True)   # the key-sorted tools, tojson()
    return render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                       thinking=True if thinking is None else thinking,
                       default_system=tok.default_system, tools_ts_str=tools_ts_str,
                       thinking_switch=tok.thinking_switch)


def special_names(n_ranks: int, added_tokens_decoder: dict | None, where: str = "tokenizer_config.json") -> dict[int, str]:
    """{id: name} for ids n_ranks .. n_ranks+255: named by added_tokens_decoder when given (entries
    outside that range are ignored, as in tokenization_kimi.py), else by FALLBACK_SPECIALS (with a
    warning); unnamed ids are <|reserved_token_ID|>."""
    if added_tokens_decoder:
        named = {}
        for key, entry in added_tokens_decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else entry
            if not isinstance(content, str):
                raise TokenizerError(f"{where}: added_tokens_decoder[{key!r}] has no string 'content'")
            named[int(key)] = content
    else:
        warnings.warn(f"{where}: no added_tokens_decoder; naming the special ids from the built-in "
                      "Kimi table (docs/kimi-k2.md section 7)", stacklevel=2)
        named = {n_ranks + offset: name for offset, name in FALLBACK_SPECIALS.items()}
    return {i: named.get(i, reserved_name(i)) for i in range(n_ranks, n_ranks + NUM_SPECIAL)}


def _chat_template_text(model_dir: Path, tok_config: dict) -> tuple[str | None, str]:
    """The checkpoint's chat template and where it came from: chat_template.jinja, else tokenizer_config.json
    "chat_template" (a string, or transformers' list of {"name", "template"}: the one named "default")."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(), str(path)
    where = str(model_dir / "tokenizer_config.json")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return (template, where) if isinstance(template, str) else (None, where)


# --- bytes -----------------------------------------------------------------------------------------

class ByteTokenizer:
    """Tiny test models (docs/interfaces.md section 2): ids 0..255 are bytes, then BOS, EOS, PAD, MASK.
    Chat prompts use the Kimi rendering; its markers are plain bytes here."""

    special_tokens = {"[BOS]": BYTE_BOS, "[EOS]": BYTE_EOS, "[PAD]": BYTE_PAD, "[MASK]": BYTE_MASK}
    id_to_special = {i: name for name, i in special_tokens.items()}
    vocab_size = 260
    bos_id, eos_id, pad_id, mask_id = BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_MASK
    stop_ids = frozenset({BYTE_EOS})
    default_system = None
    tools_as_typescript, tools_json_spaced, thinking_switch = True, False, True   # the tiny models: K2.6's format
    chat_template = None                # none in the tiny checkpoints: the hand port (--chat-template sets one)
    _special_re = re.compile("|".join(re.escape(name) for name in special_tokens))

    def __init__(self, model_vocab_size: int = 260):
        # ids 260 .. model_vocab_size-1 pad the model's vocab (to a multiple of 64); a model can
        # still emit them, so they decode visibly as [UNUSED_N] instead of failing or vanishing
        self.model_vocab_size = max(model_vocab_size, self.vocab_size)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode: expected str, got {type(text).__name__}")
        if not allow_special:
            return _byte_ids([], text.encode("utf-8"))
        ids, start = [], 0
        for match in self._special_re.finditer(text):
            _byte_ids(ids, text[start:match.start()].encode("utf-8"))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        return _byte_ids(ids, text[start:].encode("utf-8"))

    def decode_bytes(self, ids) -> bytes:
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i in self.id_to_special:
                out += self.id_to_special[i].encode("ascii")
            elif self.vocab_size <= i < self.model_vocab_size:
                out += f"[UNUSED_{i}]".encode("ascii")
            else:
                raise TokenizerError(f"token id {i} is outside the vocabulary 0..{self.model_vocab_size - 1}")
        return bytes(out)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, thinking=None,
                            tools_ts_str: str | None = None) -> str:
        return chat_text(self, messages, tools, add_generation_prompt, thinking, tools_ts_str)

    def encode_chat(self, messages, tools=None, add_generation_prompt=True, thinking=None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, thinking))


def _byte_ids(ids: list[int], data: bytes, chunk: int = 1 << 16) -> list[int]:
    """ids extended by data's bytes, a chunk at a time: a server thread encoding a long prompt lets the
    event loop's thread run between chunks (one list(data) of megabytes would hold the interpreter)."""
    for i in range(0, len(data), chunk):
        ids += data[i:i + chunk]
    return ids


# --- choose one for a checkpoint -------------------------------------------------------------------

def load_tokenizer(model_dir: str | Path, config) -> KimiTokenizer | ByteTokenizer:
    """The tokenizer of the checkpoint in `model_dir` whose config.json parsed to `config` (KimiConfig):
    bytes when config.tokenizer == "bytes", else Kimi's tiktoken.model (+ tokenizer_config.json)."""
    tok = ByteTokenizer(config.vocab_size) if config.tokenizer == "bytes" else KimiTokenizer.from_dir(model_dir)
    where = f"{Path(model_dir) / 'config.json'}"
    if config.vocab_size < tok.vocab_size:
        raise TokenizerError(f"{where}: vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{tok.vocab_size} ids")
    if config.bos_token_id != tok.bos_id:
        raise TokenizerError(f"{where}: bos_token_id {config.bos_token_id} but the tokenizer's [BOS] is {tok.bos_id}")
    for eos in config.eos_token_ids:
        if eos not in tok.stop_ids:
            raise TokenizerError(f"{where}: eos_token_id {eos} is not a stop token of the tokenizer "
                                 f"({sorted(tok.stop_ids)})")
    return tok
