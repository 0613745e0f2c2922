"""The target without its decoder layers: what training from a feature cache still computes.

A draft reads, besides the features a cache stores, the target's input embeddings (of the batch's
tokens and of DFlash's MASK token), its rotary tables at any position and its lm_head. Those come
from the target's own modules, built by transformers' class of the target at 0 decoder layers (its
embedding keeps its own scale, Gemma's, and its rotary embedding its own RoPE type), and only the
embedding and lm_head tensors are read from the checkpoint (target/weights.py): never a layer.

    target = load_light_target(target_dir, "fp32")
    target.config            the target's full config (its layer count included), as drafts read it
    target.model             embed_tokens, rotary_emb (and a norm that is never run)
    target.lm_head
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from specdraft.target.model import AUTO_DTYPE, DTYPES
from specdraft.target.checks import load_target_config
from specdraft.target.weights import load_target_head_weights


def load_light_target(target_dir: str, precision: str = "fp32") -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = load_target_config(target_dir)
    dtype = torch.float32 if precision == AUTO_DTYPE else DTYPES[precision]
    shallow = copy.deepcopy(config)
    text = shallow.get_text_config()
    text.num_hidden_layers = 0
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = []
    model = AutoModelForCausalLM.from_config(shallow, dtype=dtype)
    heads = load_target_head_weights(target_dir, dtype)
    with torch.no_grad():
        model.get_input_embeddings().weight = nn.Parameter(heads.embed_tokens, requires_grad=False)
        model.lm_head.weight = (
            model.get_input_embeddings().weight if heads.tied else nn.Parameter(heads.lm_head, requires_grad=False)
        )
    model.config = config  # what drafts and the memory model read: the real layer count
    model.model.num_target_layers = text_layers(config)
    model.eval()
    model.requires_grad_(False)
    return model


def text_layers(config) -> int:
    return config.get_text_config().num_hidden_layers
