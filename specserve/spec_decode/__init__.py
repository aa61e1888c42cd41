"""Speculation methods, chosen by ``SpeculativeConfig.method`` through :data:`PROPOSER_BUILDERS`.

A method is a :class:`~specserve.spec_decode.proposer.Proposer` and a builder here; the
speculative worker (:mod:`specserve.spec_decode.worker`) runs every one of them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from specserve.config import ModelConfig, SpeculativeConfig, SpeculativeMethod
from specserve.spec_decode.proposer import DraftProposal, Proposer, TreeProposal

if TYPE_CHECKING:
    from specserve.models.loader import LoadedModel


@dataclass
class TargetInfo:
    """What a proposer's builder may know of the target: its config and tokenizer, how it runs
    (``dtype``, ``device``, ``quantization``), its page pool (``num_blocks`` x ``block_size``; a
    draft's KV uses the same page ids) and its ``embedding [V, H]`` and ``lm_head [V, H]`` weights
    (a head shares them; ``lm_head`` may be quantized)."""

    config: ModelConfig
    tokenizer: Any
    dtype: torch.dtype
    device: str
    quantization: str
    num_blocks: int
    block_size: int
    embedding: torch.Tensor
    lm_head: Any
    kv_cache_dtype: torch.dtype | None = None   # a draft model's KV cache (default: ``dtype``)


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """Raise ``ValueError`` unless both tokenizers map every token string to the same id."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        differing = next((tok for tok, i in d_vocab.items() if t_vocab.get(tok) != i), None)
        raise ValueError(
            f"draft {draft_name!r} does not share the target's tokenizer ({len(d_vocab)} vs {len(t_vocab)} "
            f"tokens; first differing token {differing!r}): draft-target speculation needs the same vocabulary")


def _build_draft_model(cfg: SpeculativeConfig, target: TargetInfo, loaded: "LoadedModel | None") -> Proposer:
    from specserve.kv_cache.kv_cache import KVCache
    from specserve.models.llama import LlamaForCausalLM
    from specserve.models.loader import load_model, load_tokenizer
    from specserve.models.quantization import to_device
    from specserve.spec_decode.draft_model import DraftModelProposer
    from specserve.worker.model_runner import ModelRunner

    name, dtype = cfg.model, target.dtype
    quantization = cfg.draft_quantization if cfg.draft_quantization is not None else target.quantization
    if loaded is None:  # compare tokenizers before paying for the draft's weights
        check_same_tokenizer(target.tokenizer, load_tokenizer(name), name)
        # a draft's numerics never reach the output: every tensor in the asked (cheapest) layout
        loaded = load_model(name, dtype=dtype, quantization=quantization, keep_file_precision=False)
    check_same_tokenizer(target.tokenizer, loaded.tokenizer, name)
    rows = None
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < loaded.config.vocab_size:
        from specserve.spec_decode.draft_vocab import draft_vocabulary

        rows = draft_vocabulary(target.tokenizer, min(loaded.config.vocab_size, target.config.vocab_size),
                                cfg.draft_vocab_size, target.config.eos_token_ids)
    model = LlamaForCausalLM(loaded.config, to_device(loaded.weights, target.device, dtype), quantization,
                             lm_head_rows=rows).eval()
    c = loaded.config
    kv = KVCache(c.num_hidden_layers, target.num_blocks, target.block_size, c.num_key_value_heads, c.head_dim,
                 target.kv_cache_dtype or dtype, target.device)
    return DraftModelProposer(ModelRunner(model, kv), target.config.vocab_size)


def _load_head(cfg: SpeculativeConfig, target: TargetInfo):
    from specserve.models.draft_head_checkpoint import load_draft_head
    from specserve.models.quantization import QuantizedTensor
    from specserve.models.registry import resolve_head

    tc = target.config
    head, _ = load_draft_head(resolve_head(cfg.model), target_num_layers=tc.num_hidden_layers)
    bad = [i for i in head.config.aux_hidden_state_layers if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise ValueError(f"head {cfg.model!r} fuses target layers {bad}; the target has {tc.num_hidden_layers}")
    if (head.config.hidden_size, head.config.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ValueError(f"head {cfg.model!r} has hidden size {head.config.hidden_size} and vocab "
                         f"{head.config.vocab_size}; the target has {tc.hidden_size} and {tc.vocab_size}")
    head.to(device=target.device, dtype=target.dtype)
    lm_head = target.lm_head
    if isinstance(lm_head, QuantizedTensor):  # a head scores with a float copy of the target's head
        lm_head = lm_head.dequantize().to(target.dtype)
    head.attach_target(target.embedding, lm_head, keep_full_lm_head=False)
    # like a draft model, the head takes the target's quantization unless told otherwise: drafting
    # at batch 1 reads every weight per token, and the float32 head would cost most of an int4
    # target's step
    quantization = cfg.draft_quantization if cfg.draft_quantization is not None else target.quantization
    return head.quantize_(quantization, target_lm_head=target.lm_head)


def _build_mtp(cfg: SpeculativeConfig, target: TargetInfo, loaded: "LoadedModel | None") -> Proposer:
    from specserve.spec_decode.mtp import MTPProposer

    return MTPProposer(_load_head(cfg, target), target.num_blocks, target.block_size, target.config.vocab_size,
                       target.device)


def _build_eagle(cfg: SpeculativeConfig, target: TargetInfo, loaded: "LoadedModel | None") -> Proposer:
    from specserve.spec_decode.eagle import EagleProposer

    return EagleProposer(_load_head(cfg, target), target.num_blocks, target.block_size, target.config.vocab_size,
                         target.device, tree=cfg.token_tree(), depth=cfg.num_speculative_tokens,
                         topk=cfg.eagle_topk, num_draft_tokens=cfg.num_draft_tokens)


def _build_ngram(cfg: SpeculativeConfig, target: TargetInfo, loaded: "LoadedModel | None") -> Proposer:
    from specserve.spec_decode.ngram import NgramProposer

    return NgramProposer(cfg.prompt_lookup_max, cfg.prompt_lookup_min)


PROPOSER_BUILDERS: dict[SpeculativeMethod, Callable[[SpeculativeConfig, TargetInfo, "LoadedModel | None"], Proposer]] = {
    SpeculativeMethod.DRAFT_MODEL: _build_draft_model,
    SpeculativeMethod.MTP: _build_mtp,
    SpeculativeMethod.EAGLE: _build_eagle,
    SpeculativeMethod.NGRAM: _build_ngram,
}


def build_proposer(cfg: SpeculativeConfig, target: TargetInfo, loaded_draft: "LoadedModel | None" = None) -> Proposer:
    """The proposer of ``cfg.method`` for ``target`` (``loaded_draft``: an already loaded draft model).

    Raises:
        ValueError / ModelNotFoundError: a draft or head that does not fit the target, or that
            does not exist, named.
    """
    return PROPOSER_BUILDERS[SpeculativeMethod(cfg.method)](cfg, target, loaded_draft)


__all__ = ["DraftProposal", "TreeProposal", "Proposer", "TargetInfo", "build_proposer", "check_same_tokenizer",
           "PROPOSER_BUILDERS"]
