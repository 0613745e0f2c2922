"""Run INSIDE the speculators venv (not ours): load a DFlash export with speculators' own class.

    python speculators_dflash_check.py EXPORT_DIR INPUTS.pt OUT.pt

Writes {"missing", "unexpected", "mismatched"} (transformers' loading info of the file's
tensors), whether the loaded weights equal the file, and the logits of speculators' own forward
(`_backbone_forward`, eager attention, under no_grad: its flex path has no backward on CPU) at
the anchors given in INPUTS.pt.
"""

import sys

import torch

from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators_block_export import inputs_at_fixed_anchors, load_export

export_dir, inputs_path, out_path = sys.argv[1:4]

model, config, loaded = load_export(export_dir, DFlashDraftModel, DFlashSpeculatorConfig)
inputs = inputs_at_fixed_anchors(inputs_path)
ids = inputs["input_ids"]
with torch.no_grad():
    _, logits, _, _, _ = model._backbone_forward(
        inputs["hidden_states"],
        ids,
        torch.ones_like(ids),
        torch.zeros(*ids.shape, config.transformer_layer_config.hidden_size),
        torch.zeros_like(ids),
        max_anchors=inputs["anchors"].numel(),
    )
torch.save({**loaded, "mask_token_id": model.mask_token_id, "logits": logits[0]}, out_path)
