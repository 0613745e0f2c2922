"""Draft-only exports: the draft's weights without the target, in files a user can ship.

step_<N>/
  draft_model_weights.pth    state dict, `draft_model.` prefix stripped (LongSpec's layout)
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional

import torch

from specdraft.train.model import DRAFT_PREFIX

PTH_NAME = "draft_model_weights.pth"


def extract_and_rename(state_dict: Dict[str, torch.Tensor], prefix: str = DRAFT_PREFIX) -> "OrderedDict[str, torch.Tensor]":
    """Keep the keys under `prefix`, with the prefix stripped."""
    return OrderedDict((key[len(prefix):], value) for key, value in state_dict.items() if key.startswith(prefix))


def gather_draft_state_dict(engine) -> Optional[Dict[str, torch.Tensor]]:
    """The draft's full weights on rank 0 (None elsewhere); every rank must call.

    Under ZeRO-3 only the draft's parameters are gathered, never the target's.
    """
    import torch.distributed as dist

    draft = engine.module.draft_model
    params = list(draft.parameters())
    zero3 = any(hasattr(p, "ds_id") for p in params)
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero3):
        if dist.get_rank() != 0:
            return None
        named = {f"{DRAFT_PREFIX}{name}": p.detach().clone().cpu() for name, p in draft.named_parameters()}
        named.update({f"{DRAFT_PREFIX}{name}": b.detach().clone().cpu() for name, b in draft.named_buffers()})
    return dict(extract_and_rename(named))


def write_pth(state_dict: Dict[str, torch.Tensor], out_dir: Path) -> Path:
    """Write atomically: a crash leaves the previous file or none, never half of one."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PTH_NAME
    tmp = path.with_suffix(".pth.tmp")
    torch.save(state_dict, tmp)
    os.replace(tmp, path)
    return path
