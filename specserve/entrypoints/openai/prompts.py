"""Request preparation: the checks a request passes before it is queued (model, queue room) and its
prompts, tokenized by the front end and checked with ``LLMEngine.validate``, so that a bad request
is a 400 here and never reaches the step loop."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from specserve.entrypoints.openai.errors import APIError
from specserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from specserve.entrypoints.openai.server_state import ServerState
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

@dataclass
class PreparedPrompt:
    """One prompt checked and ready to queue: its text (None for token ids not echoed), ids and parameters."""
    text: str | None
    token_ids: list[int]
    params: SamplingParams


def check_model(state: ServerState, model: str) -> None:
    if model != state.served_model_name:
        raise APIError(404, f"The model {model!r} does not exist; this server serves "
                            f"{state.served_model_name!r}", param="model", code="model_not_found")


def check_queue(state: ServerState, num_new: int) -> None:
    """503 while the waiting queue cannot take ``num_new`` more sequences (n x prompts); 400 for a
    request that alone exceeds the limit, since retrying it could never succeed."""
    if num_new > state.max_queue_len:
        raise APIError(400, f"this request asks for {num_new} completions (n x prompts), more than the "
                            f"server's queue limit of {state.max_queue_len}; lower n or send fewer prompts",
                       param="n")
    if state.draining:
        raise APIError(503, "the server is shutting down", type_="service_unavailable", code="server_shutdown")
    if not state.engine.is_running:
        raise APIError(503, "the engine has stopped", type_="service_unavailable")
    waiting = state.engine.num_waiting + state.engine.num_pending
    if waiting + num_new > state.max_queue_len:
        raise APIError(503, f"the waiting queue is full ({waiting} requests waiting, limit "
                            f"{state.max_queue_len}); retry later", type_="service_unavailable",
                       code="queue_full")


def _prepare_prompt(state: ServerState, text: str | None, ids: list[int], body, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    prompt_param: str = "prompt") -> PreparedPrompt:
    """Check one prompt and its parameters; ``max_tokens=None`` means up to the context length."""
    room = state.max_model_len - len(ids)
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                            f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                            f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                       param="max_tokens")
    try:
        constraint = body.structured_outputs()
    except ValueError as e:
        raise APIError(400, e.args[1], param=e.args[0]) from None
    structured = None
    if constraint is not None:   # compiled here so that a bad schema or regex names its field
        param, structured = constraint
        try:
            state.engine.engine.grammar_compiler.compile(structured)
        except ValueError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None
    try:
        params = body.sampling_params(max_tokens if max_tokens is not None else max(room, 1), logprobs,
                                      prompt_logprobs, structured)
        state.engine.engine.validate(ids, params)
    except ValueError as e:
        raise APIError(400, str(e), param=_param_of(str(e), prompt_param)) from None
    return PreparedPrompt(text, ids, params)


def _refuse_unsupported(body) -> None:
    """400 naming the first field this server would not honour or does not know; a log warning
    for documented fields it accepts without effect."""
    refused, ignored = body.check_fields()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0])
    if ignored:
        logger.warning("request fields accepted without effect: %s", ", ".join(ignored))


# the request field a SamplingParams / validation message is about (messages start with it)
_PARAMS = ("stop_token_ids", "stop", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
           "presence_penalty", "frequency_penalty", "max_tokens", "prompt_logprobs", "logprobs", "seed", "n")


def _param_of(message: str, prompt_param: str) -> str | None:
    named = next((p for p in _PARAMS if message.startswith(p + " ")), None)
    return named or (prompt_param if message.startswith("prompt") else None)


def _encode(state: ServerState, text: str, param: str, **kw) -> list[int]:
    """Token ids of ``text``; text the tokenizer cannot take (a lone surrogate) is a 400."""
    try:
        return list(state.tokenizer.encode(text, **kw))
    except Exception:  # noqa: BLE001 - the tokenizer's own error types vary by backend
        raise APIError(400, f"the {param} could not be tokenized: it is not valid Unicode text (a lone "
                            f"surrogate, say); send valid Unicode text", param=param) from None


def completion_prompts(state: ServerState, body: CompletionRequest) -> list[PreparedPrompt]:
    """The prompts of a completions request (a string, token ids, or a list of either), each checked."""
    _refuse_unsupported(body)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)",
                       param="max_tokens")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of must equal n when given (got best_of={body.best_of}, n={body.n})",
                       param="best_of")
    p = body.prompt
    if isinstance(p, str):
        raw = [p]
    elif not p:
        raise APIError(400, "prompt is empty", param="prompt")
    elif all(isinstance(x, int) for x in p):
        raw = [list(p)]
    else:
        raw = list(p)
    prompts = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "prompt is empty: give at least one character or token id", param="prompt")
            text, ids = item, _encode(state, item, "prompt")
        else:
            text, ids = None, list(item)
        if not ids:
            raise APIError(400, f"prompt {item!r} has no tokens", param="prompt")
        prompt = _prepare_prompt(state, text, ids, body, body.max_tokens, body.logprobs,
                                 body.logprobs if body.echo else None)
        if body.echo and text is None:   # decoded only once the ids are known to be in the vocabulary
            prompt.text = state.tokenizer.decode(ids)
        prompts.append(prompt)
    return prompts


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"only text content parts are supported, got {str(part)[:80]!r}",
                           param="messages")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt(state: ServerState, body: ChatCompletionRequest) -> PreparedPrompt:
    """The chat request's messages through the tokenizer's chat template, checked."""
    _refuse_unsupported(body)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    conversation = [{**m.model_dump(exclude_none=True), "content": _message_text(m.content)}
                    for m in body.messages]
    try:
        text = state.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                   add_generation_prompt=body.add_generation_prompt)
    except Exception as e:  # jinja raises for conversations the template refuses (e.g. bad roles)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    ids = _encode(state, text, "messages", add_special_tokens=False)
    if not ids:
        raise APIError(400, "the chat template produced an empty prompt", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _prepare_prompt(state, text, ids, body, max_tokens, logprobs, prompt_param="messages")
