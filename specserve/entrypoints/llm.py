"""Offline API in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from specserve.config import DEFAULT_MODEL, EngineArgs
from specserve.engine.engine import LLMEngine
from specserve.models.loader import LoadedModel
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate text for a list of prompts in continuous batches.

    Args:
        model: a built-in name (default ``qwen2.5-coder-1.5b-instruct``), a Hugging Face folder, a
            ``.gguf`` file or a hub id.
        loaded, loaded_draft: already loaded target / draft models, instead of names (tests).
        **kwargs: :class:`~specserve.engine.engine.EngineArgs` fields (``dtype``, ``max_model_len``,
            ``block_size``, ``num_blocks``, ``max_num_seqs``, ``max_num_batched_tokens``, ``seed``,
            ``quantization`` (``"none"`` default, ``"int8"``, ``"int4"``: batch-invariant integer linears),
            ``tensor_parallel_size`` (the target sharded over that many ranks; call :meth:`shutdown`
            or use ``with LLM(...) as llm:`` to stop them before exit),
            ``speculative_config={"method": "draft_model", "model": ..., "num_speculative_tokens": k}``).
    Raises:
        ValueError: an unknown argument or model, naming it.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, loaded: LoadedModel | None = None,
                 loaded_draft: LoadedModel | None = None, **kwargs: Any):
        fields = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; valid: {sorted(fields - {'model'})}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs), loaded=loaded, loaded_draft=loaded_draft)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        """An ``LLM`` over an engine built from ``args`` (as the command line builds them)."""
        return cls(**{f: getattr(args, f) for f in EngineArgs.__dataclass_fields__})

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (also done at exit). Idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Args:
            prompts: a string, a list of token ids, ``{"prompt_token_ids": [...]}``, or a list of these.
            sampling_params: one for all prompts or one per prompt (default ``SamplingParams()``).
        Raises:
            ValueError: a bad prompt or parameter (named in the message); no request is queued then,
                so the engine keeps serving the others.
        """
        prompts = self._as_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.llm_engine
        checked = [(p, engine.validate(self._prompt_arg(p), sp)) for p, sp in zip(prompts, params)]
        ids = [engine.add_request(None, self._prompt_arg(p), sp, prompt_token_ids=tok)
               for (p, tok), sp in zip(checked, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or several) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in request_ids]

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)

    @staticmethod
    def _prompt_arg(p: PromptType) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return p["prompt"]
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
        if not isinstance(p, (str, list)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(p).__name__}")
        return p
