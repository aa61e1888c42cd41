"""Speculation methods, chosen by ``SpeculativeConfig.method`` through :data:`PROPOSER_BUILDERS`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from specserve.config import SpeculativeMethod
from specserve.spec_decode.proposer import DraftProposal, Proposer

if TYPE_CHECKING:
    from specserve.engine.engine import LLMEngine
    from specserve.models.loader import LoadedModel


def check_same_tokenizer(target_tok, draft_tok, draft_name: str) -> None:
    """Raise ``ValueError`` unless both tokenizers map every token string to the same id."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        differing = next((tok for tok, i in d_vocab.items() if t_vocab.get(tok) != i), None)
        raise ValueError(
            f"draft {draft_name!r} does not share the target's tokenizer ({len(d_vocab)} vs {len(t_vocab)} "
            f"tokens; first differing token {differing!r}): draft-target speculation needs the same vocabulary")


def _build_draft_model(engine: "LLMEngine", loaded: "LoadedModel | None") -> Proposer:
    from specserve.engine.runner import ModelRunner
    from specserve.kv_cache.kv_cache import KVCache
    from specserve.models.llama import LlamaForCausalLM
    from specserve.models.loader import load_model, load_tokenizer
    from specserve.models.quantization import to_device
    from specserve.spec_decode.draft_model import DraftModelProposer

    name = engine.spec_config.model
    dtype = engine.model.dtype
    quantization = engine.spec_config.draft_quantization
    if quantization is None:  # the target's
        quantization = engine.args.quantization
    if loaded is None:  # compare tokenizers before paying for the draft's weights
        check_same_tokenizer(engine.tokenizer, load_tokenizer(name), name)
        # a draft's numerics never reach the output: every tensor in the asked (cheapest) layout
        loaded = load_model(name, dtype=dtype, quantization=quantization, keep_file_precision=False)
    check_same_tokenizer(engine.tokenizer, loaded.tokenizer, name)
    model = LlamaForCausalLM(loaded.config, to_device(loaded.weights, engine.args.device, dtype), quantization).eval()
    cfg, bm = loaded.config, engine.block_manager
    kv = KVCache(cfg.num_hidden_layers, bm.num_blocks, bm.block_size, cfg.num_key_value_heads, cfg.head_dim,
                 dtype, engine.args.device)
    return DraftModelProposer(ModelRunner(model, kv), bm, engine.model_config.vocab_size)


def _load_head(engine: "LLMEngine"):
    from specserve.models.draft_head import load_draft_head
    from specserve.models.quantization import QuantizedTensor
    from specserve.models.registry import resolve_head

    head, _ = load_draft_head(resolve_head(engine.spec_config.model))
    cfg = engine.model_config
    if (head.config.hidden_size, head.config.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"head {engine.spec_config.model!r} has hidden size {head.config.hidden_size} and vocab "
                         f"{head.config.vocab_size}; the target has {cfg.hidden_size} and {cfg.vocab_size}")
    head.to(device=engine.args.device, dtype=engine.model.dtype)
    lm_head = engine.target_lm_head
    if isinstance(lm_head, QuantizedTensor):  # a head scores with a float copy of the target's head
        lm_head = lm_head.dequantize().to(engine.model.dtype)
    head.attach_target(engine.target_embedding, lm_head, keep_full_lm_head=False)
    return head


def _build_mtp(engine: "LLMEngine", loaded: "LoadedModel | None") -> Proposer:
    from specserve.spec_decode.mtp import MTPProposer

    return MTPProposer(_load_head(engine), engine.block_manager, engine.model_config.vocab_size, engine.args.device)


def _build_eagle(engine: "LLMEngine", loaded: "LoadedModel | None") -> Proposer:
    from specserve.spec_decode.eagle import EagleProposer

    cfg = engine.spec_config
    return EagleProposer(_load_head(engine), engine.block_manager, engine.model_config.vocab_size,
                         engine.args.device, tree=cfg.token_tree(), depth=cfg.num_speculative_tokens,
                         topk=cfg.eagle_topk, num_draft_tokens=cfg.num_draft_tokens)


def _build_ngram(engine: "LLMEngine", loaded: "LoadedModel | None") -> Proposer:
    from specserve.spec_decode.ngram import NgramProposer

    cfg = engine.spec_config
    return NgramProposer(cfg.prompt_lookup_max, cfg.prompt_lookup_min)


PROPOSER_BUILDERS: dict[SpeculativeMethod, Callable[["LLMEngine", "LoadedModel | None"], Proposer]] = {
    SpeculativeMethod.DRAFT_MODEL: _build_draft_model,
    SpeculativeMethod.MTP: _build_mtp,
    SpeculativeMethod.EAGLE: _build_eagle,
    SpeculativeMethod.NGRAM: _build_ngram,
}


def build_proposer(engine: "LLMEngine", loaded_draft: "LoadedModel | None" = None) -> Proposer:
    """The proposer of ``engine.spec_config.method``."""
    return PROPOSER_BUILDERS[SpeculativeMethod(engine.spec_config.method)](engine, loaded_draft)


__all__ = ["DraftProposal", "Proposer", "build_proposer", "check_same_tokenizer", "PROPOSER_BUILDERS"]
