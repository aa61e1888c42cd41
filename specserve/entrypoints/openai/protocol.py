"""Request bodies of the OpenAI-compatible API (OpenAI's field names, vLLM's extras), as pydantic models.

Ranges that OpenAI documents are part of the schema (so the OpenAPI document states them and a
violation is a 400 before any work is done); the rest is checked by :class:`SamplingParams`.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.sampling_params import SamplingParams

MAX_N = 128            # OpenAI's limit on completions per request
MAX_LOGPROBS = 20      # top logprobs per token (OpenAI: 5 for completions, 20 for chat)
MAX_STOP = 4           # stop strings per request, as OpenAI


class StreamOptions(BaseModel):
    include_usage: bool = True


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ``ValueError`` naming a bad value (the server answers 400)."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or a
    list of such lists; each prompt gets ``n`` choices (choice index = prompt index * n + i)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

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
