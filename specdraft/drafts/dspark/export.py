"""A DSpark draft in speculators' format (DSparkDraftModel, speculators 0.9.0): DFlash's files
(drafts/dflash/export.py) with speculators_model_type "dspark", the heads' config fields and their
tensors under the same names as ours:

    markov_head.markov_w1.weight (V, r), markov_head.markov_w2.weight (V, r),
    markov_head.gate_proj.{weight,bias} (gated) or markov_head.joint_proj.{weight,bias} (rnn),
    confidence_head.proj.{weight,bias}
    config: markov_rank, markov_head_type, enable_confidence_head (always), confidence_head_with_markov

Decoding's confidence threshold is ours (eval's), not a field of speculators' config.
"""

from __future__ import annotations

import functools

import torch

from specdraft.drafts.base import FileFormat, config_fields
from specdraft.drafts.dflash import export as dflash_speculators


# speculators' config field -> the draft key it records, besides DFlash's (read back by an import)
HEAD_SETTINGS = {"markov_head_type": "markov_head_type", "confidence_head_with_markov": "confidence_with_markov"}
FILE_FORMAT = FileFormat(
    dflash_speculators.FILE_FORMAT.state_dict,
    config_fields({**dflash_speculators.SPECULATORS_SETTINGS, **HEAD_SETTINGS}),
    dflash_speculators.FILE_FORMAT.implied,
)


def dspark_speculators_config(draft, target_config, target_dir: str, dtype: torch.dtype) -> dict:
    dims = draft.dims
    config = dflash_speculators.speculators_config(draft, target_config, target_dir, dtype)
    config.update(
        architectures=["DSparkDraftModel"],
        speculators_model_type="dspark",
        markov_rank=dims.markov_rank,
        markov_head_type=dims.markov_head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=dims.confidence_with_markov,
    )
    config["speculators_config"]["algorithm"] = "dspark"
    return config


# DFlash's writer with this config
write_speculators_export = functools.partial(
    dflash_speculators.write_speculators_export, make_config=dspark_speculators_config
)
