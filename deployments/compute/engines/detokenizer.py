"""Incremental detokenization with stop strings, one instance per request.

Two things are held back from the stream until they are settled:

* a partial UTF-8 character: with byte-level BPE one character may span several tokens;
  decoding such a prefix ends in U+FFFD, so a character is released only once it decodes
  cleanly
  (the prefix/read-offset scheme of HF text-generation-inference and vLLM: decoding a
  short window, not the whole output, keeps each step O(window));
* a suffix that could be the start of a stop string: the stream must never contain any
  part of a stop string, so ``"Hello ##"`` with stop ``"###"`` releases only ``"Hello "``
  until the next token shows whether the stop string completes.

When a stop string appears, the output ends just before its first occurrence; or, with
``include_stop`` (vLLM's ``include_stop_str_in_output``), just after it, and then nothing
is held back for a stop string that may be coming (vLLM's stop buffer is 0 then too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokenizerOutput:
    # New text to stream (may be empty while something is held back).
    text: str
    # The stop string that ended the output, if one did.
    stop: Optional[str] = None


class IncrementalDetokenizer:
    def __init__(
        self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), min_tokens: int = 0,
        include_stop: bool = False,
    ):
        """``decode`` turns a list of token ids into text (special tokens already dropped).
        Stop strings are looked for only once more than ``min_tokens`` tokens came (vLLM's
        rule: text before then is not searched again). ``include_stop``: the stop string
        that ends the output is part of it."""
        self._decode = decode
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._token_ids: list[int] = []
        # token_ids[prefix_offset:read_offset] is the decoded context for the next token.
        self._prefix_offset = 0
        self._read_offset = 0
        # Chars of the current window's new text already released (clean text that came
        # before a still-incomplete character).
        self._num_emitted_in_window = 0
        self._text = ""  # everything decoded so far (cut at a stop string once found)
        self._num_emitted = 0  # chars of _text already streamed
        self.stopped: Optional[str] = None

    @property
    def text(self) -> str:
        """All output text so far, including what is still held back."""
        return self._text

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerOutput:
        if self.stopped is not None:
            return DetokenizerOutput("", self.stopped)
        self._token_ids.extend(token_ids)
        return self._push(self._decode_new(final=False))

    def flush(self) -> str:
        """Release everything held back (call once the output ended for a reason other
        than a stop string). An incomplete trailing character becomes U+FFFD."""
        if self.stopped is not None:
            return ""
        out = self._push(self._decode_new(final=True))
        rest = self._text[self._num_emitted :]
        self._num_emitted = len(self._text)
        return out.text + rest

    def _decode_new(self, final: bool) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        start = len(prefix_text) + self._num_emitted_in_window
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            # A character is still incomplete: release the clean text before it, but keep
            # the window open so the character decodes whole once its last byte arrives.
            out = new_text.rstrip(_REPLACEMENT_CHAR)[start:]
            self._num_emitted_in_window += len(out)
            return out
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._num_emitted_in_window = 0
        return new_text[start:]

    def _push(self, new_text: str) -> DetokenizerOutput:
        if not new_text:
            return DetokenizerOutput("")
        # A stop string that ended before the old text's end would have been found then.
        search_from = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += new_text
        if self._stop and len(self._token_ids) > self._min_tokens:
            hit = self._find_stop(search_from)
            if hit is not None:
                index, stop = hit
                self._text = self._text[: index + len(stop) if self._include_stop else index]
                self.stopped = stop
                out = self._text[self._num_emitted :]
                self._num_emitted = len(self._text)
                return DetokenizerOutput(out, stop)
        end = len(self._text) - self._partial_stop_len()
        out = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return DetokenizerOutput(out)

    def _find_stop(self, start: int) -> Optional[tuple[int, str]]:
        best: Optional[tuple[int, str]] = None
        for stop in self._stop:
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop (0
        when stop strings go out anyway)."""
        if self._include_stop:
            return 0
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
