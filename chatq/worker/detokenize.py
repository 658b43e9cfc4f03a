"""The detokenize stage: token ids -> text, one token at a time, with stop strings (TextStream); and each token's own
text and bytes, for its logprob entries (Decoder).

tokenizers' DecodeStream keeps multi-byte characters and word-leading spaces whole across tokens. It starts from
the prompt's last tokens, as vLLM's does, so a SentencePiece tokenizer keeps the first word's space. Text that
could still become a stop string is held back: no part of one reaches a delta.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode

from chatq.core.chunks import TokenInfo

PROMPT_CONTEXT = 5  # prompt tokens the decoder starts from (vLLM's initial offset)

# A byte-level BPE vocab spells each byte as one printable character (GPT-2's table).
BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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


class Decoder:
    """Token ids -> strings and bytes for logprob entries, cached: the same few thousand ids come back all the time."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token = lru_cache(maxsize=65536)(self._token)
        self.raw = lru_cache(maxsize=65536)(self._raw)
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _raw(self, token_id: int) -> list[int] | None:
        """The bytes of a token that holds part of a character (None for the others: their text's UTF-8)."""
        if "\ufffd" not in self.token(token_id):
            return None
        piece = self.tokenizer.id_to_token(token_id) or ""
        if self.byte_level and all(c in BYTE_OF for c in piece):
            return [BYTE_OF[c] for c in piece]
        if fallback := BYTE_FALLBACK.fullmatch(piece):  # SentencePiece's <0xE2>
            return [int(fallback[1], 16)]
        return None

    def info(self, token_id: int, logprob, top, offset: int, as_ids: bool = False) -> TokenInfo:
        """A token's logprob entry. `as_ids` (return_tokens_as_token_ids) names every token "token_id:N", as vLLM
        does, whose bytes stay those of the sampled token's text."""
        tops: list[tuple[str, float, list[int] | None]]
        if as_ids:
            tops = [(f"token_id:{t}", lp, None) for t, lp in top]
            own = self.raw(token_id) or list(self.token(token_id).encode())
            return TokenInfo(f"token_id:{token_id}", logprob, tops, offset, own)
        tops = [(self.token(t), lp, self.raw(t)) for t, lp in top]
        return TokenInfo(self.token(token_id), logprob, tops, offset, self.raw(token_id))
