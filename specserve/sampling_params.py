"""Per-request sampling parameters, with vLLM's field names and validation rules.

Every check raises ``ValueError`` whose message names the field and the offending value, e.g.
``"temperature must be >= 0, got -0.5"``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

# vLLM treats any temperature below this as greedy decoding.
_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """The constraint of one request's output; exactly one field is set (vLLM's
    ``StructuredOutputsParams``; enforced by :mod:`specserve.structured_output`).

    Attributes:
        json: a JSON schema (a dict or its JSON text): the output is a JSON value valid under it.
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        regex: the whole output matches this regular expression (Rust ``regex`` syntax).
        choice: the output is one of these strings.
        grammar: a context-free grammar in Lark or GBNF syntax (llguidance's).
    Raises:
        ValueError: none or several set, or a value of the wrong type; the message names the field.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"structured output needs exactly one of json, json_object, regex, choice, "
                             f"grammar; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            # name the bad entry, not the whole list (it may hold thousands: the message is an HTTP 400's)
            problem = None
            if not isinstance(self.choice, (list, tuple)):
                problem = f"got {type(self.choice).__name__}"
            elif not self.choice:
                problem = "got an empty list"
            else:
                bad = next((i for i, c in enumerate(self.choice) if not (isinstance(c, str) and c)), None)
                if bad is not None:
                    problem = f"entry {bad} is {self.choice[bad]!r}"[:200]
            if problem:
                raise ValueError(f"choice must be a non-empty list of non-empty strings; {problem}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The field that is set: "json", "json_object", "regex", "choice" or "grammar"."""
        return "json_object" if self.json_object else next(
            n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)

    def key(self) -> str:
        """A text identifying the constraint (compiled grammars are cached by it)."""
        value = getattr(self, self.kind)
        return self.kind + ":" + (value if isinstance(value, str) else json.dumps(value, sort_keys=True))


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        n: number of completions to generate for the prompt (>= 1).
        temperature: softmax temperature; ``< 1e-5`` means greedy (argmax) decoding.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disable it.
        min_p: keep tokens whose probability is >= min_p * (max probability); 0 disables it.
        repetition_penalty: > 0; 1 disables it. Applied to tokens seen in prompt or output.
        presence_penalty / frequency_penalty: in [-2, 2]; applied to output tokens only.
        seed: per-request RNG seed (None = the engine's shared generator).
        stop: stop strings (a single string is normalized to a one-element list).
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS.
        max_tokens: maximum generated tokens; None = until the model's max length; 0 = none, the
            prompt is only computed (with ``prompt_logprobs``: scoring a text, as evaluation
            harnesses do).
        logprobs: number of top logprobs to return besides the sampled token's; None = none.
        prompt_logprobs: like ``logprobs`` for every prompt token after the first (vLLM's name):
            its logprob under the model given the tokens before it (log_softmax of the raw
            logits) and the top ones; None = none. Such a request computes its whole prompt
            (it is never served from the prefix cache).
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the matched stop string in the output text.
        structured_outputs: a grammar the output must follow (JSON schema, regex, choice list,
            grammar; :mod:`specserve.structured_output`), or None. Lossless with speculation: the
            output follows the target's distribution masked by the grammar.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalize the optional lists first so the checks below see lists.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or a positive integer, "
                             f"got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be a non-negative integer or None, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {v!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -2**63 <= self.seed <= 2**64 - self.n:
            # completion i of n uses seed + i, and torch generators take 64-bit seeds
            raise ValueError(f"seed must be in [-2**63, 2**64 - n], got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop entries must be non-empty strings, got {s!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids entries must be non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature below 1e-5, as in vLLM)."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def effective_top_k(self) -> int:
        """top_k with both disabled spellings (0, -1) mapped to 0; a k at or past any vocabulary
        (capped at 2**31 - 1 so it fits an int64 tensor) keeps every token."""
        return min(max(self.top_k, 0), 2**31 - 1)
