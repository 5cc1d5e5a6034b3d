"""Kimi tiktoken tokenizer and byte tokenizer: splits, specials, round trips, loading.

The BPE files are built here: all 256 single bytes plus a few merges. To check the split regex,
every hand-written expected piece is also added as a whole token; tiktoken looks a piece up
whole before merging, so the text encodes to one id per piece exactly when the split matches.
"""
import base64
import json
import random
import warnings

import pytest

from ddtree.model.presets import BYTE_BOS, BYTE_EOS, BYTE_MASK, BYTE_PAD, get_preset
from ddtree.model.tokenizer import (
    FALLBACK_SPECIALS,
    MAX_NO_WHITESPACES_CHARS,
    NUM_SPECIAL,
    TIKTOKEN_MAX_ENCODE_CHARS,
    ByteTokenizer,
    KimiTokenizer,
    TokenizerError,
    load_tokenizer,
    split_for_tiktoken,
    split_long_runs,
)

MERGES = [b"th", b"the", b" the", b"in", b"ing", b" a", b"\xe4\xbd", b"\xe4\xbd\xa0", b"er", b"  "]
# ids after the ranks, named like the real tokenizer_config.json (offsets as in 163584 + k)
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
         11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
         14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 22: "<think>",
         23: "</think>", 254: "[UNK]", 255: "[PAD]"}


def write_bpe(path, tokens: list[bytes]) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for tok in tokens:
        ranks.setdefault(tok, len(ranks))
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def make_dir(tmp_path, extra_tokens=(), named=NAMED, config=True):
    ranks = write_bpe(tmp_path / "tiktoken.model", [*MERGES, *extra_tokens])
    if config:
        n = len(ranks)
        decoder = {str(n + k): {"content": name, "special": True} for k, name in named.items()}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return ranks


SPLITS = [   # (text, hand-written pieces of the Kimi split regex)
    ("你好世界", ["你好世界"]),                                   # one Han run
    ("Hello你好", ["Hello", "你好"]),                            # Han is excluded from the letter classes
    ("你好Hello", ["你好", "Hello"]),
    (" 你好", [" ", "你好"]),                                    # no leading-space Han piece
    ("中文，测试", ["中文", "，", "测试"]),                         # fullwidth comma is punctuation
    ("I'm fine, don't", ["I'm", " fine", ",", " don't"]),        # contractions stay attached
    ("HE'S here", ["HE'S", " here"]),                            # ... case-insensitively
    ("they'll we've", ["they'll", " we've"]),
    ("HTTPServer camelCase", ["HTTPServer", " camel", "Case"]),  # upper* then lower+
    ("12345 1234567", ["123", "45", " ", "123", "456", "7"]),    # digits in groups of 1-3, no space prefix
    ("a\r\nb", ["a", "\r\n", "b"]),                              # CR/LF is its own piece
    ("Hello!\n\nWorld", ["Hello", "!\n\n", "World"]),            # punctuation takes trailing newlines
    ("x  \n  y", ["x", "  \n", " ", " y"]),                      # whitespace ending in a newline; last space joins y
    ("a   b", ["a", "  ", " b"]),                                # a run leaves one space for the next word
    ("a   ", ["a", "   "]),                                      # trailing whitespace stays whole
    ("\t\tif x:", ["\t", "\tif", " x", ":"]),
]


@pytest.mark.parametrize("text,pieces", SPLITS)
def test_split_regex_matches_hand_written_pieces(tmp_path, text, pieces):
    piece_bytes = [p.encode() for p in pieces]
    ranks = make_dir(tmp_path, [p for p in piece_bytes if len(p) > 1])
    tok = KimiTokenizer.from_dir(tmp_path)
    assert tok.encode(text) == [ranks[p] for p in piece_bytes]
    assert tok.decode(tok.encode(text)) == text


def test_every_special_is_one_id_both_ways(tmp_path):
    ranks = make_dir(tmp_path)
    tok = KimiTokenizer.from_dir(tmp_path)
    n = len(ranks)
    assert tok.vocab_size == n + NUM_SPECIAL
    assert len(tok.special_tokens) == NUM_SPECIAL
    for i in range(n, n + NUM_SPECIAL):
        name = NAMED.get(i - n, f"<|reserved_token_{i}|>")
        assert tok.id_to_special[i] == name
        assert tok.encode(name) == [i]                        # text -> one id
        assert tok.decode([i]) == name                        # id -> its text (specials kept)
        assert tok.encode(f"a{name}b") == [ord("a"), i, ord("b")]
        plain = tok.encode(name, allow_special=False)         # as ordinary text: never the special id
        assert i not in plain and tok.decode(plain) == name
    assert (tok.bos_id, tok.eos_id, tok.im_end_id, tok.pad_id) == (n, n + 1, n + 2, n + 255)
    assert tok.stop_ids == {n + 1, n + 2}


def test_fallback_special_table_without_tokenizer_config(tmp_path):
    ranks = make_dir(tmp_path, config=False)
    with pytest.warns(UserWarning, match="added_tokens_decoder"):
        tok = KimiTokenizer.from_dir(tmp_path)
    n = len(ranks)
    for offset, name in FALLBACK_SPECIALS.items():
        assert tok.special_tokens[name] == n + offset
    assert tok.id_to_special[n + 5] == f"<|reserved_token_{n + 5}|>"
    assert tok.encode("<|im_middle|><think>") == [n + 17, n + 22]


def test_round_trip_arbitrary_utf8(tmp_path):
    make_dir(tmp_path)
    tok = KimiTokenizer.from_dir(tmp_path)
    rng = random.Random(0)
    alphabet = "ab Z9 \n\r\t,.'你好世界é\u0301🙂\u200b\x00ÿ" + "<|im_end|>"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))
        ids = tok.encode(text, allow_special=False)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode()


def test_decode_bytes_across_invalid_boundaries(tmp_path):
    make_dir(tmp_path)
    tok = KimiTokenizer.from_dir(tmp_path)
    ids = tok.encode("你🙂")                                  # 3 + 4 bytes, several tokens
    assert b"".join(tok.decode_bytes([t]) for t in ids) == "你🙂".encode()
    assert len(ids) > 2
    first = tok.decode_bytes(ids[:1])                         # a token can end mid-character
    assert tok.decode(ids[:1]) == first.decode("utf-8", errors="replace")
    raw = bytes([0xE4, 0xBD]) + b"x\xff"                      # not UTF-8 at all: no token holds a ranks-gap
    byte_ids = [b for b in raw]                               # single-byte ranks are the bytes themselves
    assert tok.decode_bytes(byte_ids) == raw
    assert tok.decode(byte_ids) == raw.decode("utf-8", errors="replace")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def _reference_cuts(text: str, max_run: int) -> list[int]:
    """Brute force: cut at every (k*max_run+1)-th character of each maximal run, k >= 1."""
    cuts, start = [], 0
    for i in range(1, len(text) + 1):
        if i == len(text) or text[i].isspace() != text[start].isspace():
            cuts += range(start + max_run, i, max_run)
            start = i
    return cuts


def test_split_long_runs_against_brute_force():
    rng = random.Random(1)
    for _ in range(300):
        text = "".join(rng.choice("ab \n") * rng.randrange(1, 9) for _ in range(rng.randrange(0, 8)))
        max_run = rng.randrange(1, 6)
        pieces = split_long_runs(text, max_run)
        assert "".join(pieces) == text
        bounds = [sum(map(len, pieces[:k])) for k in range(1, len(pieces))]
        assert bounds == _reference_cuts(text, max_run)


def test_real_input_limits():
    assert (TIKTOKEN_MAX_ENCODE_CHARS, MAX_NO_WHITESPACES_CHARS) == (400_000, 25_000)
    assert [len(p) for p in split_for_tiktoken("a" * 25_001)] == [25_000, 1]
    assert [len(p) for p in split_for_tiktoken(" " * 50_001 + "b")] == [25_000, 25_000, 2]
    text = ("ab " * 140_000)[:400_003]                        # short runs: only the 400k window cuts
    assert [len(p) for p in split_for_tiktoken(text)] == [400_000, 3]


def test_encode_applies_the_input_split(tmp_path, monkeypatch):
    import ddtree.model.tokenizer as tokenizer_module
    ranks = make_dir(tmp_path, [b"aa", b"aaaa"])
    tok = KimiTokenizer.from_dir(tmp_path)
    a, aa, aaaa = ranks[b"a"], ranks[b"aa"], ranks[b"aaaa"]
    assert tok.encode("a" * 7) == [aaaa, aa, a]                # one piece
    small_limits = lambda text: split_for_tiktoken(text, max_chars=5, max_run=3)  # noqa: E731
    monkeypatch.setattr(tokenizer_module, "split_for_tiktoken", small_limits)
    # windows of 5: "aaaaa" | "aa"; runs cut at 3: "aaa" "aa" | "aa"
    assert tok.encode("a" * 7) == [aa, a, aa, aa]


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_MASK)
    assert tok.vocab_size == 260
    text = "héllo 你好 🙂\n\x00"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    assert tok.encode("[BOS]hi[EOS]") == [BYTE_BOS, 104, 105, BYTE_EOS]
    assert tok.encode("[BOS]", allow_special=False) == list(b"[BOS]")
    assert tok.decode([BYTE_BOS, 104, BYTE_MASK]) == "[BOS]h[MASK]"
    raw = bytes(range(256))
    assert tok.decode_bytes(list(raw)) == raw
    assert tok.decode(list(raw)) == raw.decode("utf-8", errors="replace")
    with pytest.raises(TokenizerError, match="260"):
        tok.decode([260])


def test_load_tokenizer_picks_by_config(tmp_path):
    tiny, _ = get_preset("tiny")
    assert isinstance(load_tokenizer(tmp_path, tiny), ByteTokenizer)
    real, _ = get_preset("kimi-k2.6", layers=4)
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        load_tokenizer(tmp_path, real)                         # error names the missing file
    ranks = make_dir(tmp_path)
    n = len(ranks)
    small = _with(tiny, tokenizer="tiktoken", vocab_size=768, bos_token_id=n, eos_token_ids=(n + 1,))
    tok = load_tokenizer(tmp_path, small)
    assert isinstance(tok, KimiTokenizer) and tok.bos_id == n
    with pytest.raises(TokenizerError, match="bos_token_id"):
        load_tokenizer(tmp_path, _with(small, bos_token_id=0))
    with pytest.raises(TokenizerError, match="vocab_size"):
        load_tokenizer(tmp_path, _with(small, vocab_size=256))


def _with(cfg, **changes):
    from dataclasses import replace
    return replace(cfg, **changes)


def test_bad_bpe_file_is_named(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="tiktoken.model"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            KimiTokenizer.from_dir(tmp_path)
