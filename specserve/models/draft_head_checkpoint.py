"""Draft-head checkpoints: the names of a head's tensors in each layout, saving and loading.

Checkpoints are written in the layouts vLLM and SGLang load, with a Hugging Face style
``config.json``: EAGLE-3's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and
EAGLE's (``fc.*``, ``layers.0.*``, and for ``normed`` ``enorm``/``hnorm``/``norm``).
:func:`load_draft_head` also maps DeepSeek-V3 MTP names (``model.layers.{N}.eh_proj`` ...) and
reports what it cannot map.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specserve.models.draft_head import DraftHead
from specserve.models.draft_head_config import DraftHeadConfig, default_aux_layers

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


_EAGLE_TOP = {"eh_proj": "fc", "shared_head.norm": "norm", "enorm": "enorm", "hnorm": "hnorm"}
_EAGLE3_TOP = ("fc", "norm", "lm_head")


def eagle_state_dict(head: DraftHead) -> dict[str, torch.Tensor]:
    """:meth:`DraftHead.eagle_state_dict`: ``head``'s weights under checkpoint names."""
    out = {}
    for name, t in head.state_dict().items():
        if name == "draft_to_target":
            continue
        out[_to_checkpoint_name(name, head.variant)] = t.detach().contiguous()
    if head.config.draft_vocab_size is not None:
        ids = head.draft_to_target
        out["d2t"] = ids - torch.arange(ids.numel())  # EAGLE-3: target id = draft id + d2t
        t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def save_draft_head(head: DraftHead, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """:meth:`DraftHead.save`: write ``head``'s ``config.json`` and ``model.safetensors``."""
    from specserve.models.loader import save_safetensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in eagle_state_dict(head).items()}
    save_safetensors(state, out / WEIGHTS_NAME, metadata={"format": "pt"})
    cfg = head.config.to_hf_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _to_checkpoint_name(name: str, variant: str) -> str:
    if variant == "eagle3":
        return name if name.split(".", 1)[0] in _EAGLE3_TOP else "midlayer." + name
    for ours, theirs in _EAGLE_TOP.items():
        if name.startswith(ours + "."):
            return theirs + name[len(ours):]
    return "layers.0." + name


_LAYER_PARTS = ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.",
                "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "input_layernorm.",
                "post_attention_layernorm.")
_TARGET_PARTS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")


def map_checkpoint_names(names: list[str], variant: str = "eagle") -> tuple[dict[str, str], list[str], list[str]]:
    """Map checkpoint tensor names to :class:`DraftHead` parameter names.

    Understands EAGLE-3's layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``; for ``variant``
    ``"eagle3"``), the EAGLE layout (``fc``, ``layers.0.*``, ``norm``, ``enorm``, ``hnorm``) and
    DeepSeek-V3's MTP layout (``model.layers.{N}.eh_proj``, ``enorm``, ``hnorm``,
    ``shared_head.norm``, the decoder layer's ``self_attn``/``mlp``/norms); ``d2t``/``t2d`` in all.
    Returns ``(mapping, target_owned, unmapped)``: checkpoint name -> ours; names that belong to
    the target (embedding, lm_head: the head shares the target's, so they are skipped; an EAGLE-3
    head's own ``lm_head`` is mapped); names with no counterpart here (e.g. DeepSeek's MLA
    attention or MoE experts).
    """
    mapping, target_owned, unmapped = {}, [], []
    for name in names:
        base = re.sub(r"^model\.layers\.\d+\.", "", name)   # DeepSeek MTP: model.layers.{N}.*
        base = re.sub(r"^model\.", "", base)
        for prefix in ("layers.0.", "midlayer."):
            if base.startswith(prefix):
                base = base[len(prefix):]
        if base in ("d2t", "t2d"):
            mapping[name] = base
        elif variant == "eagle3":
            if base.startswith(("fc.", "norm.", "lm_head.", "hidden_norm.")) or base.startswith(_LAYER_PARTS):
                mapping[name] = base
            elif base.endswith(_TARGET_PARTS):
                target_owned.append(name)
            else:
                unmapped.append(name)
        elif base.endswith(_TARGET_PARTS) or base in _TARGET_PARTS:
            target_owned.append(name)
        elif base.startswith(("fc.", "eh_proj.")):
            mapping[name] = "eh_proj." + base.split(".", 1)[1]
        elif base.startswith(("norm.", "shared_head.norm.")):
            mapping[name] = "shared_head.norm." + base.rsplit(".", 1)[1]
        elif base.startswith(("enorm.", "hnorm.")) or base.startswith(_LAYER_PARTS):
            mapping[name] = base
        else:
            unmapped.append(name)
    return mapping, target_owned, unmapped


@dataclass
class LoadReport:
    """What :func:`load_draft_head` did with every tensor of a checkpoint."""

    loaded: list[str]             # our parameter names filled from the checkpoint
    target_owned: list[str]       # checkpoint tensors skipped: the head shares the target's
    unmapped: list[str]           # checkpoint tensors with no counterpart in the head
    missing: list[str]            # head parameters the checkpoint did not provide (left at init)


def load_draft_head(path: str | Path, config: DraftHeadConfig | None = None,
                    strict: bool = True, target_num_layers: int | None = None) -> tuple[DraftHead, LoadReport]:
    """Load a head from a folder with ``config.json`` and ``*.safetensors``.

    Args:
        path: the checkpoint folder (our own, an EAGLE / EAGLE-3 one, or DeepSeek-MTP tensors).
        config: overrides the folder's ``config.json`` (required when it has none).
        strict: raise when a head parameter is missing or a tensor cannot be mapped.
        target_num_layers: the target's depth, for an EAGLE-3 checkpoint that does not name the
            layers it fuses (EAGLE-3's default (2, L // 2, L - 3) is taken).
    Raises:
        FileNotFoundError: no safetensors file, or no config and none given.
        ValueError: a tensor's shape differs from the head's, or (strict) missing/unmapped names,
            or an EAGLE-3 checkpoint without its fused layers and no ``target_num_layers``.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    if config is None:
        cfg_file = folder / CONFIG_NAME
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found; pass a DraftHeadConfig")
        config = DraftHeadConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    if config.variant == "eagle3" and not config.aux_hidden_state_layers:
        if target_num_layers is None:
            raise ValueError(f"EAGLE-3 checkpoint {folder} does not name the target layers it fuses "
                             "(eagle_config.eagle_aux_hidden_state_layer_ids); pass target_num_layers")
        config = replace(config, aux_hidden_state_layers=default_aux_layers(target_num_layers))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    mapping, target_owned, unmapped = map_checkpoint_names(list(tensors), config.variant)
    head = DraftHead(config)
    own = dict(head.state_dict())
    state, loaded = {}, []
    d2t = None
    for src, dst in mapping.items():
        if dst == "d2t":
            d2t = tensors[src].to(torch.int64)
            continue
        if dst == "t2d":
            continue
        if dst not in own:
            unmapped.append(src)   # e.g. a norm the eagle variant has no place for
            continue
        if tuple(tensors[src].shape) != tuple(own[dst].shape):
            raise ValueError(f"{src}: shape {tuple(tensors[src].shape)}, the head's {dst} is {tuple(own[dst].shape)}")
        state[dst] = tensors[src].to(own[dst].dtype)
        loaded.append(dst)
    if d2t is not None:
        state["draft_to_target"] = d2t + torch.arange(d2t.numel())
        loaded.append("draft_to_target")
    missing = [n for n in own if n not in state and n != "draft_to_target"]
    if strict and (missing or unmapped):
        raise ValueError(f"checkpoint {folder}: missing {missing}, cannot map {unmapped}")
    head.load_state_dict(state, strict=False)
    return head, LoadReport(sorted(loaded), target_owned, unmapped, missing)
