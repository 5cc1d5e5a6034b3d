"""Token ids -> text a client may be shown now, and the server-sent-events framing.

A DDTree step commits several tokens at once, and its last token may end in the middle of a UTF-8
character (a byte tokenizer, or a BPE token that splits one) or in the middle of a stop string. Text
is released only once it is final:

    TextStream(tokenizer, stop_ids, stops)
    .feed(ids) -> str          the text that became final with these tokens ("" while held back)
    .feed_step(ids)            the same token by token, up to the one that completes a stop string
    .finish() -> str           the rest at the end of the run (an unfinished character becomes U+FFFD)
    .stopped                   True once a stop string matched: the text is cut right before it

Held back: an incomplete UTF-8 sequence (the incremental decoder keeps its bytes), and the longest tail
of the text that is a proper prefix of some stop string (it may still become that stop string). A
stop string is found at its first occurrence in the whole output, also across steps; the output ends
right before it (OpenAI's `stop`: the stop sequence is not returned). Stop token ids (EOS, <|im_end|>)
end the run in the engine and are never shown.
"""
from __future__ import annotations

import codecs
import json


class StopMatcher:
    """Text in, text out, with every stop string cut exactly and partial matches held back."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""               # text not yet released: a possible start of a stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:                        # nothing released so far can start a stop (it was held back)
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def finish(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class TextStream:
    def __init__(self, tokenizer, stop_ids=frozenset(), stops: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.matcher = StopMatcher(stops or [])
        self.decoded = 0                # characters the UTF-8 decoder has produced (before stop matching)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def feed(self, ids) -> str:
        shown = [int(t) for t in ids if int(t) not in self.stop_ids]
        decoded = self.utf8.decode(self.tokenizer.decode_bytes(shown))
        self.decoded += len(decoded)
        return self.matcher.feed(decoded)

    def feed_step(self, ids) -> tuple[str, int, list[int]]:
        """A step's tokens fed one at a time, stopping at the token that completes a stop string ->
        (the text made final, how many tokens were used, each used token's character offset in the decoded
        output). Tokens after a stop string's match are not part of the output (nor of completion_tokens)."""
        pieces, offsets = [], []
        for t in ids:
            offsets.append(self.decoded)
            pieces.append(self.feed([t]))
            if self.stopped:
                break
        return "".join(pieces), len(offsets), offsets

    def finish(self) -> str:
        return self.matcher.feed(self.utf8.decode(b"", final=True)) + self.matcher.finish()


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the string)."""
    body = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"data: {body}\n\n"
