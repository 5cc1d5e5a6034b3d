"""TextStream / StopMatcher against the plain answer: whatever the token boundaries, the released text
concatenates to the whole output cut right before the first stop string, nothing released is ever
taken back, and an incomplete UTF-8 character or a partial stop string is held until resolved."""
from __future__ import annotations

import random

from ddtree.model.tokenizer import ByteTokenizer
from ddtree.server.streaming import StopMatcher, TextStream, sse

TEXT = "naïve café — 数学 ok 🙂 stop here: END marker, then ENDS again"


def expected(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def run(ids: list[int], cuts: list[int], stops: list[str]):
    stream = TextStream(ByteTokenizer(), stop_ids={257}, stops=stops)
    pieces = []
    for a, b in zip([0] + cuts, cuts + [len(ids)]):
        pieces.append(stream.feed(ids[a:b]))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream.stopped


def test_random_splits_equal_the_whole_text_cut_at_the_first_stop():
    rng = random.Random(0)
    ids = list(TEXT.encode())
    stop_sets = [[], ["END"], ["ENDS", "END"], ["数学"], ["🙂"], ["é —"], ["nowhere", "marke"], ["x" * 40],
                 ["again"], ["n"]]
    for stops in stop_sets:
        want, want_stopped = expected(TEXT, stops)
        for _ in range(60):
            cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(0, 12)))
            pieces, stopped = run(ids, cuts, stops)
            assert "".join(pieces) == want and stopped == want_stopped, (stops, cuts)


def test_incomplete_utf8_is_held_back():
    stream = TextStream(ByteTokenizer())
    smile = "🙂".encode()                              # 4 bytes
    assert [stream.feed([b]) for b in smile[:3]] == ["", "", ""]
    assert stream.feed([smile[3]]) == "🙂"
    assert stream.feed([0xE6]) == "" and stream.finish() == "\ufffd"   # a cut character at the end


def test_partial_stop_held_then_released_or_cut():
    m = StopMatcher(["</answer>"])
    assert m.feed("x </ans") == "x "                  # "</ans" may still become the stop string
    assert m.feed("wer") == ""
    assert m.feed("!") == "</answer!" and not m.stopped
    assert m.feed("ok</answer>tail") == "ok" and m.stopped
    assert m.feed("more") == "" and m.finish() == ""


def test_stop_ids_are_never_shown():
    stream = TextStream(ByteTokenizer(), stop_ids={257})
    assert stream.feed([104, 105, 257]) == "hi"


def test_sse_framing():
    assert sse("[DONE]") == "data: [DONE]\n\n"
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'
