"""ZeRO-3's partitioned parameters made whole where a step needs them (collectives: every rank
must call)."""

from __future__ import annotations

from typing import Dict, Optional

import torch


def gathered(params: list):
    """Context in which `params` are whole on every rank: ZeRO-3 gathers them (a collective,
    every rank must enter); at other stages they already are, and this does nothing."""
    import deepspeed

    zero3 = any(hasattr(p, "ds_id") for p in params)
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero3)


def gather_draft_state_dict(engine) -> Optional[Dict[str, torch.Tensor]]:
    """The draft's full weights (CPU copies, no prefix) on rank 0, None elsewhere; every rank
    must call. Under ZeRO-3 only the draft's parameters are gathered, never the target's."""
    import torch.distributed as dist

    draft = engine.module.draft_model
    with gathered(list(draft.parameters())):
        if dist.get_rank() != 0:
            return None
        return {name: t.detach().clone().cpu() for name, t in draft.state_dict().items()}
