"""Request bodies of the OpenAI-compatible API (OpenAI's field names, vLLM's extras), as pydantic models.

Ranges that OpenAI documents are part of the schema (so the OpenAPI document states them and a
violation is a 400 before any work is done); the rest is checked by :class:`SamplingParams`.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128            # OpenAI's limit on completions per request
MAX_LOGPROBS = 20      # top logprobs per token (OpenAI: 5 for completions, 20 for chat)
MAX_STOP = 4           # stop strings per request, as OpenAI

# Fields of OpenAI's or vLLM's documented request schemas that do not change what this server
# returns: accepted and ignored, with a log warning (clients such as guidellm, LangChain or the
# openai client's extra_body send some of them).
IGNORED_FIELDS = frozenset({
    "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier", "prediction",
    "reasoning_effort", "verbosity", "priority", "request_id", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "spaces_between_special_tokens", "guided_decoding_backend", "guided_whitespace_pattern", "chat_template_kwargs",
    "documents", "mm_processor_kwargs", "return_tokens_as_token_ids", "length_penalty", "early_stopping",
    "add_special_tokens"})
# Documented fields whose meaning this server does not implement: accepted at their "off" values only
# (a 400 names the field otherwise, never a silently different output).
OFF_VALUES: dict[str, tuple] = {
    "functions": (None, []), "function_call": (None, "none"), "prompt_logprobs": (None,), "min_tokens": (None, 0),
    "use_beam_search": (None, False), "allowed_token_ids": (None, []), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "modalities": (None, ["text"]), "audio": (None,),
    "web_search_options": (None,), "structural_tag": (None,), "continue_final_message": (None, False),
    "chat_template": (None,), "logits_processors": (None,), "echo": (None, False)}   # echo: chat (vLLM's extra)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Strict types: ``"stream": "yes"``,
    ``"max_tokens": true`` or a prompt of booleans are errors, not coerced (JSON integers still
    fill float fields)."""

    model_config = ConfigDict(extra="allow", strict=True)   # extras are sorted by check_fields

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # extras (vLLM's spelling)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, vLLM's guided_* extras
    response_format: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted so that they can be refused by name (400) rather than silently ignored
    tools: list | None = None
    tool_choice: str | dict | None = None
    metadata: dict | None = None

    def structured_outputs(self) -> tuple[str, StructuredOutputsParams] | None:
        """The output constraint and the field that gave it: OpenAI's ``response_format``
        (``json_object``, ``json_schema``) or vLLM's ``guided_json`` / ``guided_regex`` /
        ``guided_choice`` / ``guided_grammar``; None for free text.

        Raises:
            ValueError: ``(param, message)`` as its args: an unknown format type, a json_schema
                without a schema, or several constraints at once.
        """
        given = []
        fmt = self.response_format
        if fmt is not None and fmt.get("type") != "text":
            kind = fmt.get("type")
            if kind == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format", "response_format json_schema needs "
                                     "'json_schema': {'name': ..., 'schema': {...}} with the schema an object")
                given.append(("response_format", {"json": schema}))
            else:
                raise ValueError("response_format", f"response_format type {kind!r} is not supported: "
                                 f"use 'text', 'json_object' or 'json_schema'")
        for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {field: getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(given[1][0], f"give one output constraint, got {', '.join(g[0] for g in given)}")
        param, kw = given[0]
        try:
            return param, StructuredOutputsParams(**kw)
        except ValueError as e:
            raise ValueError(param, f"{param}: {e}") from None

    def check_fields(self) -> tuple[tuple[str, str] | None, list[str]]:
        """``((param, message) or None, ignored)``: the first field this server would not honour or
        does not know (OpenAI answers an unrecognized argument with a 400), and the documented
        fields it accepts without effect (:data:`IGNORED_FIELDS`)."""
        extras = dict(self.model_extra or {})
        ignored = sorted(k for k in extras if k in IGNORED_FIELDS)
        for name, value in extras.items():
            if name in IGNORED_FIELDS:
                continue
            if name not in OFF_VALUES:
                return (name, f"Unrecognized request argument supplied: {name}"), ignored
            if value not in OFF_VALUES[name]:
                why = {"functions": "function calling is not supported (the model's calls would come back as "
                                    "plain text); send no functions",
                       "function_call": "function calling is not supported",
                       "prompt_logprobs": "prompt_logprobs is not served: use /v1/completions with echo=true and "
                                          "logprobs, which returns the prompt's logprobs"}.get(name)
                return (name, why or f"{name}={value!r} is not supported by this server"), ignored
        if self.stream_options is not None and not self.stream:
            return ("stream_options", "stream_options is only allowed when stream is true"), ignored
        return self.refuse_unsupported(), ignored

    def refuse_unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for a field whose meaning this server would not honour, else None."""
        if self.tool_choice not in (None, "none", "auto"):
            return ("tool_choice", f"tool_choice {self.tool_choice!r} demands a tool call, which this server "
                                   f"does not produce")
        if self.tools and self.tool_choice != "none":
            return ("tools", "tool calling is not supported: the model's tool calls would come back as plain "
                             "text; send tool_choice 'none' to use the tools only as context, or no tools")
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ``ValueError`` naming a bad value (the server answers 400)."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured_outputs)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or a
    list of such lists; each prompt gets ``n`` choices (choice index = prompt index * n + i).
    ``echo``: each choice's text starts with its prompt, and with ``logprobs`` its logprobs cover
    the prompt's tokens too (the first one's is null); ``max_tokens`` may then be 0 (scoring)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; the prompt is the tokenizer's chat template over ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    add_generation_prompt: bool = True


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
