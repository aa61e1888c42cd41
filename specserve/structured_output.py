"""Structured output: a grammar (JSON schema, regex, choice list, Lark/GBNF grammar) constrains which
tokens a request may emit, with speculation on and lossless.

The grammar engine is llguidance (Microsoft's, also a vLLM and llama.cpp backend): it compiles a
grammar against the tokenizer and, for a parse state, computes the set of tokens that keep the
output a prefix of the language (the *mask*). What this module adds is the state each request
keeps and how speculation reads it:

* :class:`GrammarState` is one sequence's matcher. The engine advances it only when it commits
  tokens (:meth:`GrammarState.accept`); workers read masks after a *prefix* of uncommitted
  tokens, the drafts before a verified position (:meth:`GrammarState.allowed_token_mask`), and
  leave the committed state as they found it.
* The mask is a logits processor: applied after the penalties and before temperature, top-k/p,
  min-p and softmax (:func:`specserve.sample.sampler.compute_probs`), it
  defines the distribution sampled from. Speculation masks the target's verify row j with the state
  after drafts d_1..d_{j-1} and the draft's own distribution the same way, so rejection sampling
  (Leviathan et al. 2023, section 2.3) keeps the output distributed as the masked target's and
  greedy output equals greedy output without speculation. Deterministic drafts (n-gram) and tree
  nodes the grammar refuses are cut before verification.
* EOS (every one of the model's EOS ids) is allowed exactly where the grammar accepts the output
  as complete; once the grammar is complete and nothing can follow, EOS is the only token allowed.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import torch

from specserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer and hands out matchers.

    Args:
        tokenizer: the engine's Hugging Face fast tokenizer.
        vocab_size: the model's vocabulary (logits width; ids past the tokenizer's are never allowed).
        eos_token_ids: the model's EOS ids; each is allowed where the grammar may end.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 32):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._lltok = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()   # constraint -> matcher at its start
        self._lock = threading.Lock()
        self._cache_size = cache_size

    @property
    def lltokenizer(self):
        """llguidance's view of the tokenizer (built once, on first use: ~1 s for a 150k vocabulary)."""
        if self._lltok is None:
            import llguidance.hf

            # the tokenizer may hold more ids than the model's logits (masks are cut to those) or fewer
            n_vocab = max(self.vocab_size, self.tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True))
            self._lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab,
                                                       eos_token=self.eos_token_ids or None)
        return self._lltok

    def compile(self, params: StructuredOutputsParams):
        """An llguidance matcher at the start of ``params``' language, checked against the
        tokenizer (it is built here, off the engine's loop in the server: a large grammar takes
        seconds; :meth:`new_state` copies it). Cached by the constraint's text.

        Raises:
            ValueError: an invalid schema, regex or grammar, one whose language is empty, or one
                past llguidance's size limits, with llguidance's reason and the field.
        """
        key = params.key()
        with self._lock:   # the server compiles on its preparation threads, the engine copies on its own
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        from llguidance import LLMatcher, grammar_from

        kind = params.kind
        try:
            if kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
            elif kind == "json":
                schema = params.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
                grammar = LLMatcher.grammar_from_json_schema(schema)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(params.regex)
            elif kind == "choice":
                grammar = grammar_from("choice", params.choice)
            else:
                grammar = grammar_from("grammar", params.grammar)
            error = LLMatcher.validate_grammar(grammar, self.lltokenizer)
            if error:
                raise ValueError(error)
            matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)
            if not matcher.is_error():
                matcher.compute_bitmask()   # an empty language shows here: "no extension" at the start
            if matcher.is_error():
                raise ValueError(matcher.get_error())
        except (ValueError, RecursionError) as e:   # json.JSONDecodeError is a ValueError; deep nesting recurses
            raise ValueError(f"invalid {kind}: {_reason(str(e))}") from None
        with self._lock:
            self._compiled[key] = matcher
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def new_state(self, params: StructuredOutputsParams) -> "GrammarState":
        """A fresh matcher at the start of the output (raises like :meth:`compile`)."""
        return GrammarState(self.compile(params).deep_copy(), self.vocab_size, self.eos_token_ids)


def _reason(error: str) -> str:
    """llguidance's error as one short line (it becomes an HTTP 400's message): no parser dump or
    backtrace; an empty language said in words."""
    if error.startswith("NoExtensionBias"):
        return "the constraint allows no output at all (its language is empty)"
    for cut in ("<state>", "<backtrace>"):
        error = error.split(cut)[0]
    error = " ".join(error.split())
    return error if len(error) <= 400 else error[:400] + " ..."


class GrammarState:
    """One sequence's position in its grammar.

    Args:
        matcher: an llguidance ``LLMatcher`` at the sequence's committed output.
        vocab_size: width of the masks.
        eos_token_ids: the model's EOS ids.
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = torch.tensor(list(eos_token_ids), dtype=torch.int64)
        self._eos = frozenset(eos_token_ids)
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}   # prefix -> mask, for this committed state

    def accept(self, token_id: int) -> bool:
        """Commit one output token (the engine's commit only); False if the grammar refuses it
        (the state is then unchanged)."""
        self._masks.clear()
        return self.matcher.try_consume_tokens([token_id]) == 1

    @property
    def error(self) -> str:
        """Why the last :meth:`accept` failed inside llguidance (a resource limit), or ""."""
        return _reason(self.matcher.get_error()) if self.matcher.is_error() else ""

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar allows after the committed output
        (EOS counts only where the grammar may end; nothing after it)."""
        tokens = list(token_ids)
        n = self.matcher.validate_tokens(tokens)
        # llguidance counts no EOS once the grammar has stopped; the mask allows it there
        if n < len(tokens) and tokens[n] in self._eos and self.allowed_token_mask(tokens[:n])[tokens[n]]:
            n += 1
        return n

    @property
    def is_terminated(self) -> bool:
        """Nothing but EOS can follow the committed output."""
        return self.matcher.is_stopped()

    def allowed_token_mask(self, prefix: Sequence[int] = ()) -> torch.Tensor:
        """``[V]`` bool: tokens allowed after the committed output followed by ``prefix`` (uncommitted
        drafts). A prefix the grammar refuses allows nothing; tokens after an EOS change nothing
        (the sequence ends there: EOS alone stays allowed). Memoized until the next commit, so a
        draft's mask and the verify row at the same position cost one computation."""
        key = tuple(prefix)
        end = next((i for i, t in enumerate(key) if t in self._eos), None)
        if end is not None:
            key = key[:end + 1]
        mask = self._masks.get(key)
        if mask is not None:
            return mask
        m = self.matcher
        if end is not None:   # the output ended: EOS alone, if the EOS was allowed where it stands
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            if self.allowed_token_mask(key[:-1])[key[-1]]:
                mask[self.eos_token_ids] = True
            self._masks[key] = mask
            return mask
        n = m.try_consume_tokens(list(key)) if key else 0
        if n < len(key):
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        else:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            n_bits = min(len(bits), self.vocab_size)
            mask[:n_bits] = torch.from_numpy(bits[:n_bits].astype(np.bool_))
            if len(self.eos_token_ids):   # every EOS id where the grammar may end, none elsewhere
                mask[self.eos_token_ids] = bool(mask[self.eos_token_ids].any()) or m.is_accepting()
                if not mask.any():   # a dead end the grammar should never reach: let the sequence end
                    logger.warning("grammar allows no token after %d draft tokens; allowing EOS", len(key))
                    mask[self.eos_token_ids] = True
        if n:
            m.rollback(n)
        self._masks[key] = mask
        return mask
