"""Token ids -> text, one token at a time, with stop strings.

tokenizers' DecodeStream keeps multi-byte characters and word-leading spaces whole across tokens; it starts from
the prompt's last tokens, as vLLM's detokenizer does, so that a SentencePiece tokenizer keeps the space before the
first word. On top of it, text that could still become a stop string is held back, so no part of a stop string
ever reaches a delta.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 5  # prompt tokens the decoder starts from (vLLM's initial offset)


@dataclass
class Piece:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that ended generation, if one matched


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: list[str],
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT:]) or None
        self.decoder = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.stops = stops
        self.include_stop = include_stop
        self.held = ""
        # While min_tokens holds stops off: the end of the text sent, where a stop string found later may begin.
        self.sent_tail = ""
        self.tail_len = max((len(s) for s in stops), default=1) - 1

    def add(self, token: int, check_stops: bool = True) -> Piece:
        new = self.decoder.step(self.tokenizer, token) or ""
        if not self.stops:
            return Piece(new)
        if not check_stops:
            sent = self.sent_tail + new
            self.sent_tail = sent[max(len(sent) - self.tail_len, 0) :]
            return Piece(new)
        # A stop string may straddle what was held back (or sent before stops counted) and the new text.
        before, self.sent_tail = self.sent_tail, ""
        text = before + self.held + new
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = text.find(stop, max(len(before) - len(stop) + 1, 0))  # only a stop that reaches past `before`
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            end = i + len(stop) if self.include_stop else i
            self.held = ""
            return Piece(text[len(before) : max(end, len(before))], stop)
        pending = text[len(before) :]
        keep = self._partial_stop_len(pending)
        out, self.held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        return Piece(out)

    def flush(self) -> str:
        """Generation ended without a stop string: what was held back is ordinary text."""
        out, self.held = self.held, ""
        return out

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
