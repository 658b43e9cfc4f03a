"""Token ids -> text, one token at a time, with stop strings.

tokenizers' DecodeStream keeps multi-byte characters and word-leading spaces whole across tokens. It starts from
the prompt's last tokens, as vLLM's does, so a SentencePiece tokenizer keeps the first word's space. Text that
could still become a stop string is held back: no part of one reaches a delta.
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
        self.decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Stepped through, not passed as DecodeStream(ids=...): given a prompt that ends inside a character, that
        # returns the whole context, prompt text included, once the first generated token completes it.
        for t in prompt_ids[-PROMPT_CONTEXT:]:
            self.decoder.step(tokenizer, t)
        self.stops = stops
        self.include_stop = include_stop
        self.held = ""
        self.decoded = 0  # characters of text decoded so far, held back or not

    def add(self, token: int, check_stops: bool = True) -> Piece:
        """The token's text that can be sent now. While min_tokens holds stop strings off (`check_stops` false)
        none is matched, but text that may become one is still held back, as vLLM does: one that begins there and
        completes once they count then ends the text where it begins."""
        new = self.decoder.step(self.tokenizer, token) or ""
        self.decoded += len(new)
        if not self.stops:
            return Piece(new)
        text = self.held + new
        if check_stops:
            best: tuple[int, str] | None = None
            for stop in self.stops:
                # Only a stop string that ends in the new text: one within what was held before is not one.
                i = text.find(stop, max(len(self.held) - len(stop) + 1, 0))
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, stop)
            if best is not None:
                i, stop = best
                self.held = ""
                return Piece(text[: i + len(stop) if self.include_stop else i], stop)
        keep = self._partial_stop_len(text)
        out, self.held = text[: len(text) - keep], text[len(text) - keep :]
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
