"""A DFlash2 draft in speculators' format (DFlash2SpeculatorConfig / DFlash2DraftModel, speculators
0.9.0; what vLLM serves with method dflash, chosen by its architectures): DFlash's files
(drafts/dflash/export.py) with speculators_model_type "dflash2", architectures
["DFlash2DraftModel"], algorithm "dflash2" and the convolutions' and selector's fields, flat; the
tensors under speculators' names (the layers' attention_conv / mlp_conv, candidate_selector.*)."""

from __future__ import annotations

import functools

import torch

from specdraft.drafts.base import FileFormat, config_fields
from specdraft.drafts.dflash import export as dflash_export

# speculators' config field -> the draft key it records (an import reads them back)
SETTINGS = {
    **dflash_export.SPECULATORS_SETTINGS,
    "conv_kernel_size": "conv_kernel_size",
    "conv_group_size": "conv_group_size",
    "selector_rank": "selector_rank",
    "selector_top_k": "selector_top_k",
}
FILE_FORMAT = FileFormat(
    dflash_export.FILE_FORMAT.state_dict, config_fields(SETTINGS), dflash_export.FILE_FORMAT.implied
)


def dflash2_speculators_config(draft, target_config, target_dir: str, dtype: torch.dtype) -> dict:
    config = dflash_export.speculators_config(draft, target_config, target_dir, dtype)
    d = draft.dims
    config.update(
        architectures=["DFlash2DraftModel"],
        speculators_model_type="dflash2",
        conv_kernel_size=d.conv_kernel_size,
        conv_group_size=d.conv_group_size,
        selector_rank=d.selector_rank,
        selector_top_k=d.selector_top_k,
    )
    config["speculators_config"]["algorithm"] = "dflash2"
    return config


write_speculators_export = functools.partial(
    dflash_export.write_speculators_export, make_config=dflash2_speculators_config
)
