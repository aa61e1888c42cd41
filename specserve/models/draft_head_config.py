"""The shape of a draft head (:class:`DraftHeadConfig`), its Hugging Face ``config.json`` form, and
EAGLE-3's default choice of fused target layers. The head itself: :mod:`specserve.models.draft_head`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from specserve.config import ModelConfig

HEAD_VARIANTS = ("eagle3", "eagle", "normed")


@dataclass
class DraftHeadConfig:
    """Shape of a draft head. Width, attention shape and RoPE follow the target.

    Attributes:
        variant: ``"eagle"`` or ``"normed"``.
        vocab_size: the target's vocabulary size.
        draft_vocab_size: tokens the head scores (None: the whole target vocabulary).
        target_architecture: the target's ``ModelConfig.architecture`` ("llama" | "qwen2").
        aux_hidden_state_layers: ``eagle3``: the target layers whose input residual stream ``fc``
            fuses (empty: EAGLE-3's default (2, L // 2, L - 3), filled in for the target).
        own_lm_head: ``eagle3``: the head has its own ``lm_head [draft vocab, H]`` (trained, saved)
            instead of the target's rows.
    """

    variant: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    draft_vocab_size: int | None = None
    target_architecture: str = "llama"
    aux_hidden_state_layers: tuple[int, ...] = ()
    own_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.variant not in HEAD_VARIANTS:
            raise ValueError(f"variant must be one of {HEAD_VARIANTS}, got {self.variant!r}")
        self.aux_hidden_state_layers = tuple(int(i) for i in self.aux_hidden_state_layers)
        if self.variant != "eagle3" and (self.aux_hidden_state_layers or self.own_lm_head):
            raise ValueError(f"aux_hidden_state_layers and own_lm_head are for variant 'eagle3', not {self.variant!r}")
        if self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, target: ModelConfig, variant: str, intermediate_size: int | None = None,
                   draft_vocab_size: int | None = None, aux_hidden_state_layers: tuple[int, ...] | None = None,
                   own_lm_head: bool = False) -> "DraftHeadConfig":
        """A head for ``target``; the MLP is as wide as the target's unless ``intermediate_size``;
        an ``eagle3`` head fuses ``aux_hidden_state_layers`` (default: EAGLE-3's three)."""
        aux = ()
        if variant == "eagle3":
            aux = tuple(aux_hidden_state_layers or default_aux_layers(target.num_hidden_layers))
        return cls(variant=variant, hidden_size=target.hidden_size,
                   intermediate_size=intermediate_size or target.intermediate_size,
                   num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                   head_dim=target.head_dim, vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, max_position_embeddings=target.max_position_embeddings,
                   attention_bias=target.attention_bias, draft_vocab_size=draft_vocab_size,
                   target_architecture=target.architecture, aux_hidden_state_layers=aux, own_lm_head=own_lm_head)

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_hidden_state_layers)

    def to_hf_dict(self) -> dict:
        """``config.json`` contents: the target's Hugging Face fields with one layer, EAGLE's
        architecture name, and our own fields under ``specserve_head``."""
        extra = {}
        if self.variant == "eagle3":   # what vLLM and SGLang read to feed an EAGLE-3 head
            arch = "LlamaForCausalLMEagle3"   # their EAGLE-3 class for every target
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_hidden_state_layers),
                                     "use_aux_hidden_state": True}
            extra["target_hidden_size"] = self.hidden_size
        else:
            arch = "Qwen2ForCausalLMEagle" if self.target_architecture == "qwen2" else "LlamaForCausalLMEagle"
        return {
            "architectures": [arch],
            "model_type": self.target_architecture,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size or self.vocab_size,
            "attention_bias": self.attention_bias, "torch_dtype": "float16", **extra,
            "specserve_head": asdict(self),
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DraftHeadConfig":
        """Inverse of :meth:`to_hf_dict`. A foreign config (no ``specserve_head``) is read from
        its Hugging Face fields: ``eagle3`` when its architecture says Eagle3 or it has an
        ``eagle_config`` (its own lm_head; fused layers from ``eagle_aux_hidden_state_layer_ids``,
        else EAGLE-3's default, filled in for the target), else ``eagle``."""
        if "specserve_head" in d:
            names = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in d["specserve_head"].items() if k in names})
        heads = d["num_attention_heads"]
        draft_vocab = d.get("draft_vocab_size")
        eagle3 = "eagle_config" in d or any("Eagle3" in a for a in d.get("architectures", []))
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or ()
        bias_default = False if eagle3 else d.get("model_type") == "qwen2"
        return cls(variant="eagle3" if eagle3 else "eagle", hidden_size=d["hidden_size"],
                   intermediate_size=d["intermediate_size"],
                   num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
                   rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d.get("max_position_embeddings", 2048),
                   attention_bias=d.get("attention_bias", bias_default),
                   draft_vocab_size=None if draft_vocab in (None, d["vocab_size"]) else draft_vocab,
                   target_architecture=d.get("model_type", "llama"), aux_hidden_state_layers=tuple(aux),
                   own_lm_head=eagle3)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high target layers, as vLLM and SGLang pick them:
    (2, L // 2, L - 3), clipped and deduplicated for shallow models."""
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)}))
