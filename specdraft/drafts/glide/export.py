"""GLIDE in LongSpec's files: the directory LongSpec's inference code (longspec/test/*_glide.py)
loads a draft from.

    draft_model_weights.pth   the draft layer under LongSpec's names (no `draft_model.` prefix)
    config.json               the TARGET's config: LongSpec builds the draft layer from it
    tokenizer files           the target's
    training_config.yaml      the run's (written beside every serving format by the export)

Names: ours are LongSpec's but for the two norms before the cross-attention and the MLP. LongSpec's
cross-attention is a whole attention module whose k_proj / v_proj it never uses (it reads the
target's keys and values): they are written as zeros of their shape, and an import skips them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, Optional

import torch

from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import CONFIG_NAME, PTH_NAME
from specdraft.target.config_file import read_target_config, target_config_path

# ours -> LongSpec's; every other name is the same in both
RENAMED = {
    "cross_layernorm.weight": "post_self_attention_layernorm.weight",
    "post_attention_layernorm.weight": "post_cross_attention_layernorm.weight",
}
UNUSED = ("cross_attn.k_proj", "cross_attn.v_proj")  # present in LongSpec's layer, never read


def longspec_state_dict(draft, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Our GLIDE state dict under LongSpec's names, with its unused cross-attention k/v as zeros."""
    out = {RENAMED.get(name, name): tensor for name, tensor in state_dict.items()}
    d = draft.dims
    like = state_dict["cross_attn.q_proj.weight"]
    for name in UNUSED:  # shaped like the target's k/v projections: LongSpec builds them from its config
        out[f"{name}.weight"] = like.new_zeros(d.target_kv_heads * d.head_dim, d.hidden_size)
        if d.attention_bias:
            out[f"{name}.bias"] = like.new_zeros(d.target_kv_heads * d.head_dim)
    return out


def longspec_refusal(dims) -> Optional[str]:
    if dims.final_norm:
        return "draft.final_norm: LongSpec's GLIDE layer feeds lm_head without a final norm (export native instead)"
    return None


def write_longspec(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    from transformers import AutoTokenizer

    refusal = longspec_refusal(draft.dims)
    if refusal:
        raise SpecdraftError(refusal)
    read_target_config(target_dir)  # LongSpec builds the draft layer from it: a readable one, copied as it is
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in longspec_state_dict(draft, state_dict).items()}
    torch.save(tensors, out_dir / PTH_NAME)
    shutil.copyfile(target_config_path(target_dir), out_dir / CONFIG_NAME)
    AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(str(out_dir))
