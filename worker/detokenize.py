"""Token ids -> text, one token at a time, with stop strings.

tokenizers' DecodeStream keeps multi-byte characters and word-leading spaces whole across tokens. On top of it,
text that could still become a stop string is held back, so no part of a stop string ever reaches a delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stops = stops
        self.include_stop = include_stop
        self.held = ""

    def add(self, token: int, check_stops: bool = True) -> Piece:
        new = self.decoder.step(self.tokenizer, token) or ""
        if not self.stops or not check_stops and not self.held:
            return Piece(new)
        pending = self.held + new
        # A stop string may straddle what was held back and the new text, so search the held part too.
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = pending.find(stop)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            out = pending[: i + len(stop)] if self.include_stop else pending[:i]
            self.held = ""
            return Piece(out, stop)
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
