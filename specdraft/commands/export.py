"""`specdraft export`: a draft's files from a committed slot of a run (the slot is verified first,
its DeepSpeed state read by checkpoint/consolidate.py; the run is only read, except for the
export written into it)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from specdraft.checkpoint.consolidate import consolidated_draft_state_dict
from specdraft.checkpoint.draft_names import choose_draft, record_names
from specdraft.checkpoint.slots import run_slot
from specdraft.config import draft_view
from specdraft.drafts.registry import draft_from_export_config
from specdraft.errors import SpecdraftError
from specdraft.export.files import NATIVE_FILES, write_draft_export
from specdraft.rundir.layout import config_file, draft_part, offline_export_dir
from specdraft.rundir.ownership import check_export_out
from specdraft.target.model import load_target_tokenizer
from specdraft.target.checks import has_tokenizer


EXPORT_FORMATS = ("native", "pth", "safetensors")  # plus each family's serving formats


def export_from_run(
    run_dir,
    step: Optional[int] = None,
    fmt: str = "native",
    out_dir: Optional[str] = None,
    with_target_heads: bool = False,
    draft_name: Optional[str] = None,
) -> Path:
    """Write a draft export from a committed slot: `native` (both weight files + config.json), one
    native file (`pth` / `safetensors`), or a serving format of the draft's family (returns the
    directory that engine loads). draft_name: the draft of a several-draft run (required there)."""
    slot_dir, record = run_slot(run_dir, step=step)
    name = choose_draft(record_names(record), draft_name, "export")
    own = record if name is None else record["drafts"][name]
    default = draft_part(offline_export_dir(run_dir, record["step"]), name)
    out = Path(out_dir) if out_dir else default
    check_export_out(out, run_dir, default)  # before the weights are consolidated
    draft = draft_from_export_config(own["draft"])
    if fmt not in EXPORT_FORMATS and fmt not in draft.serving_formats:
        raise SpecdraftError(
            f"--format {fmt}: a {draft.family} draft exports as {', '.join([*EXPORT_FORMATS, *draft.serving_formats])}"
        )
    draft.load_state_dict(consolidated_draft_state_dict(draft_part(slot_dir, name), record), strict=True)
    state_dict = {k: v.detach().clone() for k, v in draft.state_dict().items()}
    cfg = OmegaConf.load(config_file(run_dir))
    cfg = cfg if name is None else draft_view(cfg, name)  # the config of this draft, as trained alone
    tokenizer = load_target_tokenizer(cfg.target) if has_tokenizer(cfg.target) else None
    heads = None
    if with_target_heads:  # two tensors straight from the target's files: the target is never built
        from specdraft.target.weights import load_target_head_weights

        read = load_target_head_weights(
            cfg.target, dtype=torch.float32, expected_hidden=own["draft"]["dims"]["hidden_size"]
        )
        heads = {"embed_tokens.weight": read.embed_tokens, "lm_head.weight": read.lm_head}
    serving = [fmt] if fmt in draft.serving_formats else []
    files = (fmt,) if fmt in NATIVE_FILES else NATIVE_FILES
    written = write_draft_export(
        out,
        state_dict,
        draft,
        cfg,
        tokenizer,
        formats=files,
        target_heads=heads,
        serving=serving,
        run_dir=run_dir,
        step=record["step"],
    )
    return written / fmt if serving else written
