"""Incremental detokenization and stop strings: the cost per token does not grow with the output.

Decoding the whole output again for every new token costs O(n) per token (O(n^2) a request). A
:class:`IncrementalDetokenizer` feeds one token at a time to the tokenizers library's
``DecodeStream``, which keeps a short window of recent ids and returns the text the new token
completes (nothing while a multi-byte character is still incomplete). The concatenated pieces equal
``tokenizer.decode(output_ids)``; tokenizers without a Rust backend, or that clean up spaces
around punctuation after decoding (a whole-text rule), fall back to decoding the whole output.
"""
from __future__ import annotations


def _backend(tokenizer):
    """The tokenizers ``Tokenizer`` behind a transformers tokenizer, or None when incremental
    decoding would not reproduce ``tokenizer.decode`` (no Rust backend, space clean-up)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return getattr(tokenizer, "_tokenizer", None)


class IncrementalDetokenizer:
    """The text of one sequence's output, grown token by token.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: as ``tokenizer.decode``'s.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend = _backend(tokenizer)
        self.ids: list[int] = []
        self.pending: list[int] = []   # ids whose text is not complete yet (a partial UTF-8 character)
        self.text = ""
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream
            self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completed ("" while a character is incomplete)."""
        self.ids.append(token_id)
        if self.backend is None:
            full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            piece, self.text = full[len(self.text):], full
            return piece
        piece = self.stream.step(self.backend, token_id)
        if piece is None:
            self.pending.append(token_id)
            return ""
        self.pending.clear()
        self.text += piece
        return piece

    def final_text(self) -> str:
        """The whole text, an incomplete trailing character included (as ``decode`` renders it)."""
        if not self.pending:
            return self.text
        return self.text + self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens)


def find_stop_string(text: str, stops: list[str], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends at or after index ``new_from`` (the text
    before it was checked already): ``(index, stop)``, or None. Cost: the new text plus the
    longest stop string, whatever the length of ``text``."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, new_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
