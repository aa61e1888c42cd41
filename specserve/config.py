"""Validated configuration dataclasses shared by every part of the engine.

``ModelConfig`` describes a Llama-family decoder (Llama, Qwen2, SmolLM2) with the field names of a
Hugging Face ``config.json``, so a loaded HF config maps onto it one to one.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from specserve.shipped_heads import builtin_heads, shipped_head_for


# weight quantizations the engine serves (specserve.models.quantization has the layouts)
QUANTIZATIONS = ("none", "int8", "int4")


def check_quantization(value, what: str = "quantization") -> str:
    """``value`` normalised (None -> "none"); raises ValueError naming it when unknown."""
    if value is None:
        return "none"
    if not isinstance(value, str) or value.lower() not in QUANTIZATIONS:
        raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(QUANTIZATIONS)}")
    return value.lower()


# EAGLE-1's default tree (its repository's ``mc_sim_7b_63`` choice): 25 draft tokens, depth 5.
EAGLE1_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
)


@dataclass(frozen=True)
class TreeSpec:
    """A static tree shape: draft nodes as paths of child ranks, breadth-first.

    Attributes:
        paths: ``N`` paths, sorted by depth then rank; node i (1-based in a :class:`DraftTree`) is
            ``paths[i - 1]``.
        parents: ``[N + 1]`` parent node of each node, ``parents[0] = -1`` (the root).
        ranks: ``[N + 1]`` rank of each node among its parent's children (0 = most likely).
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    @classmethod
    def from_paths(cls, paths) -> "TreeSpec":
        """Raises ValueError for an empty list, a rank < 0, a duplicate path or a path whose prefix
        is missing (every node's parent must be in the tree), naming the path."""
        norm = []
        for p in paths:
            try:
                path = tuple(int(r) for r in p)
            except (TypeError, ValueError):
                raise ValueError(f"a tree path must be a list of child ranks, got {p!r}") from None
            if not path or any(r < 0 for r in path):
                raise ValueError(f"a tree path must be a non-empty list of ranks >= 0, got {list(p)!r}")
            norm.append(path)
        if not norm:
            raise ValueError("a static tree needs at least one path")
        if len(set(norm)) != len(norm):
            dup = next(p for p in norm if norm.count(p) > 1)
            raise ValueError(f"tree path {list(dup)} appears twice")
        known = set(norm)
        for p in norm:
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        ordered = tuple(sorted(norm, key=lambda p: (len(p), p)))
        index = {p: i + 1 for i, p in enumerate(ordered)}
        parents = (-1,) + tuple(index[p[:-1]] if len(p) > 1 else 0 for p in ordered)
        ranks = (0,) + tuple(p[-1] for p in ordered)
        return cls(ordered, parents, ranks)

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        """A linear chain of k drafts (each node's most likely child)."""
        return cls.from_paths([(0,) * d for d in range(1, k + 1)])

    @property
    def num_draft_tokens(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)


SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# Defaults of the engine and the command line, in one place.
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"  # drafts for DEFAULT_MODEL (same tokenizer)
DEFAULT_NUM_SPECULATIVE_TOKENS = 3  # best k measured by `specserve bench` (BENCHMARKS.md, "Decode beside llama.cpp")
DEFAULT_QUANTIZATION = "int4"  # the command line's: the fastest mode whose quality holds (BENCHMARKS.md)
DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, device: str) -> str:
    """The KV cache's dtype name for ``kv_cache_dtype`` (``auto``: float16 for a float32 model on the
    CPU, else the model's ``dtype``)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "float16" if dtype == "float32" and str(device).startswith("cpu") else dtype


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes use Hugging Face ``config.json`` names. ``attention_bias`` is True for Qwen2, whose
    q/k/v projections carry a bias. ``eos_token_ids`` lists every token that ends generation
    (Qwen's instruct models end on ``<|im_end|>`` and raw completions on ``<|endoftext|>``).
    """

    architecture: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (``model_type`` llama or qwen2)."""
        model_type = hf.get("model_type", "llama")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it in rope_parameters
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SchedulerConfig:
    """Batch limits: at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens a step."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


class SpeculativeMethod(str, enum.Enum):
    """Names of the speculation methods (``speculative_config["method"]``)."""

    DRAFT_MODEL = "draft_model"
    MTP = "mtp"
    EAGLE = "eagle"
    NGRAM = "ngram"


SPECULATIVE_METHODS = tuple(m.value for m in SpeculativeMethod)


@dataclass
class SpeculativeConfig:
    """``speculative_config`` of ``LLM(...)`` (vLLM's spelling).

    Attributes:
        method: ``"draft_model"`` (a separate small LLM drafts; Leviathan et al. 2023) or
            ``"mtp"`` (a one-layer EAGLE / MTP head drafts a chain from the target's hidden states) or
            ``"eagle"`` (the same head drafts a tree: static with ``speculative_token_tree``, else
            EAGLE-2's dynamic tree) or ``"ngram"`` (prompt lookup: drafts copied from the
            sequence's earlier tokens; no model).
        model: the draft: a built-in name, HF folder, ``.gguf`` file or hub id; for ``"mtp"`` and
            ``"eagle"`` a head checkpoint folder or shipped head name (see
            :mod:`specserve.models.draft_head`; None: the head shipped for the target, filled in by
            :class:`EngineArgs`); unused by ``"ngram"``.
        num_speculative_tokens: k, draft tokens proposed per step (>= 1); for ``"eagle"`` the tree's
            depth (a static tree sets it to its own depth).
        draft_quantization: the draft model's (or head's) ``quantization``: ``None`` (the same as the target's),
            ``"none"`` (float), ``"int8"`` or ``"int4"``. A draft's numerics change which tokens are
            proposed, never which are emitted: the target verifies every token.
        adaptive: choose k <= ``num_speculative_tokens`` for every decode step from measured
            acceptance and step cost, down to 0 (no speculation) for large batches
            (:mod:`specserve.spec_decode.adaptive`). False: always k. Greedy output is the same
            either way; seeded sampled output depends on the k of each step.
        prompt_lookup_max / prompt_lookup_min: ``"ngram"`` only: the n-gram lengths matched,
            longest first (vLLM's names).
        speculative_token_tree: ``"eagle"`` only: a static tree as a list of paths of child ranks
            (``[[0], [1], [0, 0]]``, or that list as a string, vLLM's spelling) or ``"eagle1"``
            (EAGLE-1's default 25-node tree); None: a dynamic tree.
        eagle_topk / num_draft_tokens: ``"eagle"`` dynamic trees: children per expanded node and
            nodes expanded per level; nodes kept for verification (EAGLE-2's top-k and total tokens).
        draft_vocab_size: ``"draft_model"`` only: the draft scores only this many of the corpus's
            most frequent tokens (FR-Spec; :mod:`specserve.spec_decode.draft_vocab`), so its lm_head
            reads that many rows; None: the whole vocabulary. Output stays exact either way.
    """

    method: str = SpeculativeMethod.DRAFT_MODEL
    model: str | None = None
    num_speculative_tokens: int = 4
    draft_quantization: str | None = None
    adaptive: bool = True
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    speculative_token_tree: Any = None
    eagle_topk: int = 4
    num_draft_tokens: int = 12
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:  # str-enum members compare equal to their names
            raise ValueError(f"unknown speculative method {self.method!r}; choose from {SPECULATIVE_METHODS}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if self.draft_quantization is not None:
            self.draft_quantization = check_quantization(self.draft_quantization, "draft_quantization")
        for name in ("prompt_lookup_max", "prompt_lookup_min", "eagle_topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.draft_vocab_size is not None:
            if self.method != SpeculativeMethod.DRAFT_MODEL:
                raise ValueError(f"draft_vocab_size is for method 'draft_model', not {str(getattr(self.method, 'value', self.method))!r}")
            if not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool) or self.draft_vocab_size < 2:
                raise ValueError(f"draft_vocab_size must be an integer >= 2, got {self.draft_vocab_size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.speculative_token_tree is not None:
            if self.method != SpeculativeMethod.EAGLE:
                raise ValueError(f"speculative_token_tree is for method 'eagle', not {str(getattr(self.method, 'value', self.method))!r}")
            self.num_speculative_tokens = self.token_tree().depth
        if self.method == SpeculativeMethod.NGRAM:
            self.model = None
        elif not self.model and self.method == SpeculativeMethod.DRAFT_MODEL:
            raise ValueError("speculative method 'draft_model' needs a draft 'model'")

    def token_tree(self) -> TreeSpec | None:
        """The static tree ``speculative_token_tree`` describes (None: dynamic).

        Raises:
            ValueError: a string that is not a list of paths or a preset name, or a malformed tree.
        """
        tree = self.speculative_token_tree
        if tree is None:
            return None
        if isinstance(tree, str):
            if tree == "eagle1":
                tree = EAGLE1_TREE
            else:
                import ast
                try:
                    tree = ast.literal_eval(tree)
                except (ValueError, SyntaxError):
                    raise ValueError(f"speculative_token_tree must be 'eagle1' or a list of paths like "
                                     f"'[(0,), (1,), (0, 0)]', got {self.speculative_token_tree!r}") from None
        if not isinstance(tree, (list, tuple)):
            raise ValueError(f"speculative_token_tree must be a list of paths, got {tree!r}")
        return TreeSpec.from_paths(tree)

    @classmethod
    def from_dict(cls, d: "dict[str, Any] | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """Accept a dict (unknown keys are an error naming them), a config, or None."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; valid: {sorted(known)}")
        return cls(**d)


@dataclass
class EngineArgs:
    """Everything needed to build an engine (vLLM's argument names).

    ``kv_cache_memory_gb`` sizes the page pool when ``num_blocks`` is not given. ``quantization``
    (vLLM's name): ``"none"`` (float weights), ``"int8"`` or ``"int4"`` (batch-invariant integer
    linears, :mod:`specserve.models.quantization`); the draft's is ``speculative_config``'s
    ``draft_quantization`` (default: the same as the target's). ``tensor_parallel_size`` (vLLM's
    name) shards the target over that many ranks (:mod:`specserve.distributed`; the draft stays
    whole on rank 0); ``distributed_timeout_s`` bounds how long a step waits for a rank.
    ``enable_prefix_caching`` (vLLM's name, on by default as there): requests reuse the cached
    pages of a prompt prefix seen before, the target's and the draft's / head's entries alike
    (:mod:`specserve.kv_cache.block_manager`). ``kv_cache_dtype`` (vLLM's name): the paged KV
    cache's element type for the target and a draft model, ``float32``, ``float16`` or ``bfloat16``;
    ``auto`` (default): float16 for a float32 model on the CPU (half the bytes a step reads; its
    quality against float32 entries is in BENCHMARKS.md), else the model's dtype.

    Raises:
        ValueError: a bad value, named (dtype, quantization with a non-float32 dtype or a non-CPU
            device, max_model_len < 2, block_size / max_num_seqs / max_num_batched_tokens /
            num_blocks < 1, kv_cache_memory_gb <= 0, tensor_parallel_size < 1, a bad speculative_config).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    device: str = "cpu"
    speculative_config: "SpeculativeConfig | dict | None" = None
    quantization: str = "none"
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        spec = self.speculative_config
        if spec is not None and spec.method in (SpeculativeMethod.MTP, SpeculativeMethod.EAGLE) and not spec.model:
            spec.model = shipped_head_for(self.model)
            if spec.model is None:
                raise ValueError(f"speculative method {getattr(spec.method, 'value', spec.method)!r} needs a draft "
                                 f"'model': no head ships for target {self.model!r} (shipped: {builtin_heads()})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.quantization = check_quantization(self.quantization)
        if self.quantization != "none":
            if self.dtype != "float32":
                raise ValueError(f"quantization {self.quantization!r} runs float32 activations; "
                                 f"use dtype float32, not {self.dtype!r}")
            if self.device != "cpu":
                raise ValueError(f"quantization {self.quantization!r} has CPU kernels only; "
                                 f"device {self.device!r} has none (use quantization 'none')")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        # checked here, before any weights load, not after
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s!r}")
