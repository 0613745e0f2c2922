"""One draft's weights out of a committed slot's DeepSpeed files: its trained parameters in fp32
(DeepSpeed's zero_to_fp32 from the ZeRO shards, or the module saved whole at stage 0) and its
untrained state exactly as saved; `specdraft consolidate` writes them as one safetensors file."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional

import torch

from specdraft.checkpoint.draft_names import choose_draft, record_names
from specdraft.checkpoint.slots import run_slot
from specdraft.checkpoint.untrained_state import read_untrained_state
from specdraft.drafts.base import DRAFT_PREFIX
from specdraft.rundir.atomic import write_atomic
from specdraft.rundir.layout import consolidated_file, draft_part


def consolidated_draft_state_dict(slot_dir: Path, record: dict) -> Dict[str, torch.Tensor]:
    """The draft's full state dict from a verified slot: its trained parameters in fp32 via
    DeepSpeed's zero_to_fp32, and its untrained state (buffers, frozen parameters) exactly as saved."""
    return {
        **_trained_fp32(slot_dir, record),
        **read_untrained_state(slot_dir),
    }  # zero_to_fp32's float copies of buffers give way


def _trained_fp32(slot_dir: Path, record: dict) -> Dict[str, torch.Tensor]:
    if record["zero_stage"] == 0:  # zero_to_fp32 does not handle stage 0: the module is saved whole
        states = torch.load(slot_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
        full = states["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        full = get_fp32_state_dict_from_zero_checkpoint(
            str(slot_dir.parent), tag=slot_dir.name, exclude_frozen_parameters=True
        )
    return {k: v.float() for k, v in extract_and_rename(full).items()}


def consolidate_run(run_dir, slot: Optional[str] = None, draft: Optional[str] = None) -> Path:
    """draft: the name of a draft of a several-draft run (required there)."""
    from safetensors.torch import save_file

    slot_dir, record = run_slot(run_dir, slot=slot)
    name = choose_draft(record_names(record), draft, "consolidate")
    state_dict = consolidated_draft_state_dict(draft_part(slot_dir, name), record)
    whole = consolidated_file(run_dir, slot_dir)
    out = draft_part(whole.parent, name) / whole.name
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, lambda tmp: save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp)))
    return out


def extract_and_rename(
    state_dict: Dict[str, torch.Tensor], prefix: str = DRAFT_PREFIX
) -> "OrderedDict[str, torch.Tensor]":
    """Keep the keys under `prefix`, with the prefix stripped."""
    return OrderedDict((key[len(prefix) :], value) for key, value in state_dict.items() if key.startswith(prefix))
