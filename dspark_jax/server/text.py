"""Token ids to streamed text for the HTTP server: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas without re-decoding
the whole output each time: it decodes a short window of already-emitted tokens plus the new
ones and keeps the suffix, and holds text back while the last token ends in the middle of a
UTF-8 character (the decoder shows U+FFFD for it). `StopStrings` holds back the tail of the text
that could still become a stop string, and cuts the text before the first one found (OpenAI:
the stop string is not part of the returned text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for token ids appended one batch at a time.

    `add(ids)` returns the new text (possibly ""). `flush()` returns what is still held back at
    the end of the request (an incomplete UTF-8 character decodes as U+FFFD, as in a full
    decode). The concatenation of every delta equals `tok.decode(all_ids, skip_special_tokens)`
    for byte-level BPE tokenizers, whose decoding concatenates per token.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # ids before this index have been turned into text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if not final and (len(full) <= len(before) or full.endswith(_REPLACEMENT)):
            return ""  # nothing printable yet, or a character split across tokens
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(before) :]


class StopStrings:
    """Finds the first stop string in streamed text; holds back a tail that might start one.

    `push(text)` returns `(releasable_text, stopped)`. Once `stopped`, the text before the stop
    string has been released and the rest is dropped. `flush()` releases the held-back tail at
    the end of a request that did not stop on a string.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return buf[:cut], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
