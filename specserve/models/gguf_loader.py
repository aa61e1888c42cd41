"""GGUF files -> Hugging Face-layout float32 safetensors, a :class:`ModelConfig` and a tokenizer.

Conversion happens once per file: every tensor is dequantized with ``gguf.quants.dequantize`` and
streamed to disk as float32 (one tensor in memory at a time), so later loads are a plain
``safetensors`` read. llama.cpp's converter permutes the rows of ``llama``-architecture ``attn_q``
/ ``attn_k`` weights (it interleaves the two rotary halves of each head); we undo that here so the
weights match Hugging Face's rotate-half layout. ``qwen2`` GGUFs are not permuted.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from specserve.config import SUPPORTED_ARCHITECTURES, ModelConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "specserve_config.json"
TOKENIZER_DIR = "tokenizer"
# Bump when the converted layout changes, so stale caches are not reused.
FORMAT_VERSION = 1

# Extra tokens that end generation when present in the vocabulary (besides the GGUF's eos id).
STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that carry no information our models use (precomputed RoPE tables).
_IGNORED = ("rope_freqs.weight",)
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFFormatError(ValueError):
    """A GGUF file whose architecture, metadata or tensors this loader cannot use."""


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face parameter name for a GGUF tensor name, or None for tensors we skip.

    Raises:
        GGUFFormatError: for a tensor name this loader does not know.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _IGNORED:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise GGUFFormatError(f"unknown GGUF tensor {gguf_name!r} (not a Llama/Qwen2 parameter)")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for one projection weight or bias.

    llama.cpp stores, within each head, rows in the order (pair index, half) where Hugging Face uses
    (half, pair index). ``w`` has shape ``[n_head * head_dim, ...]``; returns the same shape.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFFormatError(f"cannot unpermute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _field(reader, key: str, default: Any = None, required: bool = False) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFFormatError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def _token_ids(reader, texts: tuple[str, ...]) -> dict[str, int]:
    """Ids of the given token strings in ``tokenizer.ggml.tokens`` (absent ones left out)."""
    f = reader.fields.get("tokenizer.ggml.tokens")
    if f is None:
        return {}
    wanted = {t.encode("utf-8"): t for t in texts}
    found: dict[str, int] = {}
    for token_id, part_index in enumerate(f.data):
        raw = bytes(f.parts[part_index])
        if raw in wanted:
            found[wanted[raw]] = token_id
            if len(found) == len(wanted):
                break
    return found


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(f"{float(x):.7g}")


def read_config(reader) -> ModelConfig:
    """Build a :class:`ModelConfig` from an open ``gguf.GGUFReader``'s metadata and tensor shapes.

    Raises:
        GGUFFormatError: unsupported architecture or missing metadata.
    """
    arch = _field(reader, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFFormatError(
            f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise GGUFFormatError("GGUF file has no token_embd.weight tensor")
    hidden = int(_field(reader, f"{arch}.embedding_length", required=True))
    heads = int(_field(reader, f"{arch}.attention.head_count", required=True))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = int(names["token_embd.weight"].shape[1])  # GGUF shape is [hidden, vocab]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos is None else [int(eos)]
    for token_id in _token_ids(reader, STOP_TOKENS).values():
        if token_id not in eos_ids:
            eos_ids.append(token_id)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", required=True)),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def open_reader(path: str | os.PathLike):
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped); raises GGUFFormatError if unreadable."""
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as e:  # gguf raises ValueError/struct errors on corrupt files
        raise GGUFFormatError(f"{str(path)!r} is not a readable GGUF file: {e}") from None


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """Float32 values of one GGUF tensor's raw data (a thin wrapper so tests can observe calls)."""
    from gguf.quants import dequantize as _dequantize

    return np.asarray(_dequantize(data, qtype), dtype=np.float32)


def _atomic_dir(final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished temp file/dir into place; if another process won the race, keep theirs."""
    try:
        os.replace(tmp, final)
    except OSError:
        if final.exists():
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        else:
            raise


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, desc: str | None = None) -> ModelConfig:
    """Dequantize every tensor of ``gguf_path`` into ``out_dir/model.safetensors`` (float32, HF names).

    Also writes ``out_dir/specserve_config.json`` (``ModelConfig.to_dict()``). Both files appear
    atomically. Peak memory is about one tensor. Shows its progress (a bar on a terminal, log lines elsewhere). Returns the ModelConfig.

    Raises:
        GGUFFormatError: unreadable file, unsupported architecture or unknown tensors.
    """
    from specserve.progress import progress

    reader = open_reader(gguf_path)
    config = read_config(reader)
    plan = []  # (hf name, gguf tensor, numpy shape)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            plan.append((name, t, tuple(int(d) for d in reversed(t.shape.tolist()))))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": os.path.basename(str(gguf_path))}}
    offset = 0
    for name, _, shape in plan:
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
    total = sum(int(t.n_elements) for _, t, _ in plan)
    bar = progress(total=total, unit="param", unit_scale=True,
               desc=desc or f"dequantizing {os.path.basename(str(gguf_path))}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(header_bytes)))
            fh.write(header_bytes)
            for name, t, shape in plan:
                w = dequantize(t.data, t.tensor_type).reshape(shape)
                if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    w = unpermute_qk(w, config.num_attention_heads)
                elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    w = unpermute_qk(w, config.num_key_value_heads)
                fh.write(np.ascontiguousarray(w, dtype="<f4").tobytes())
                bar.update(int(t.n_elements))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    _publish(tmp, out / WEIGHTS_FILE)
    write_config(config, out / CONFIG_FILE)
    return config


def write_config(config: ModelConfig, path: Path) -> None:
    """Write ``config.to_dict()`` as JSON to ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config.to_dict(), indent=2))
    _publish(tmp, path)


def read_config_file(path: Path) -> ModelConfig:
    """Inverse of :func:`write_config` (float32-derived fields normalised as in :func:`read_config`)."""
    data = json.loads(Path(path).read_text())
    for key in ("rms_norm_eps", "rope_theta"):
        data[key] = _f32(data[key])
    return ModelConfig(**data)


def build_tokenizer(gguf_path: str | os.PathLike, out_dir: str | os.PathLike):
    """Build transformers' tokenizer from the GGUF (slow) and save it to ``out_dir/tokenizer``.

    Returns the tokenizer reloaded from the saved folder, so the first and later loads behave the same.

    Raises:
        GGUFFormatError: transformers cannot build a tokenizer from this file.
    """
    from transformers import AutoTokenizer

    path = Path(gguf_path)
    final = Path(out_dir) / TOKENIZER_DIR
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise GGUFFormatError(f"cannot build a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from None
    tmp = _atomic_dir(final)
    tok.save_pretrained(str(tmp))
    _publish(tmp, final)
    return AutoTokenizer.from_pretrained(str(final))


def read_quantized(gguf_path: str | os.PathLike, quantization: str, desc: str | None = None,
                   keep_file_precision: bool = True):
    """Read a GGUF for the int8 / int4 kernels: ``(ModelConfig, weights)``.

    Linear weights (q/k/v/o, gate/up/down, the output head) become
    :class:`~specserve.models.quantization.QuantizedTensor` in the layout
    :func:`~specserve.models.quantization.layout_for` picks from the tensor's GGUF type (Q4_K and
    Q6_K blocks are copied, others re-quantized from their float values one tensor at a time);
    the token embedding, norms and biases are float32. A tied model also gets ``lm_head.weight``
    quantized from the embedding's blocks. ``keep_file_precision=False`` (drafts) puts every linear
    in the asked layout. Shows its progress (a bar on a terminal, log lines elsewhere).

    Raises:
        GGUFFormatError: unreadable file, unsupported architecture or unknown tensors.
        ValueError: a weight whose shape the layout cannot pack (naming the tensor).
    """
    import torch
    from specserve.progress import progress

    from specserve.models.quantization import from_gguf, layout_for

    reader = open_reader(gguf_path)
    config = read_config(reader)
    plan = [(hf_name(t.name), t) for t in reader.tensors]
    plan = [(name, t) for name, t in plan if name is not None]
    weights: dict = {}
    bar = progress(total=sum(int(t.n_elements) for _, t in plan), unit="param", unit_scale=True,
               desc=desc or f"loading {os.path.basename(str(gguf_path))}")
    try:
        for name, t in plan:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            gtype = t.tensor_type.name
            linear = name.endswith(".weight") and len(shape) == 2 and name != "model.embed_tokens.weight"
            perm = None
            if config.architecture == "llama" and ("q_proj" in name or "k_proj" in name):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                perm = unpermute_qk(np.arange(shape[0]), heads)
            if linear:
                qt = from_gguf(name, t.data, gtype, shape, layout_for(quantization, gtype, keep_file_precision), dequantize)
                weights[name] = qt if perm is None else qt.select_rows(torch.from_numpy(perm))
            else:
                w = dequantize(t.data, t.tensor_type).reshape(shape)
                if perm is not None:
                    w = w[perm]
                weights[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
                if name == "model.embed_tokens.weight" and config.tie_word_embeddings:
                    weights["lm_head.weight"] = from_gguf("lm_head.weight", t.data, gtype, shape,
                                                          layout_for(quantization, gtype, keep_file_precision), dequantize)
            bar.update(int(t.n_elements))
    finally:
        bar.close()
    return config, weights
