"""Run INSIDE the speculators venv (not ours): load a DFlash export with speculators' own class.

    python speculators_dflash_check.py EXPORT_DIR INPUTS.pt OUT.pt

Writes {"missing", "unexpected", "mismatched"} (transformers' loading info of the file's
tensors), whether the loaded weights equal the file, and the logits of speculators' own forward
(`_backbone_forward`, eager attention, under no_grad: its flex path has no backward on CPU) at
the anchors given in INPUTS.pt.
"""

import sys

import torch
from safetensors.torch import load_file

import speculators.models.dflash.core as dflash_core
from speculators.model import SpeculatorModel
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

export_dir, inputs_path, out_path = sys.argv[1:4]

config = DFlashSpeculatorConfig.from_pretrained(export_dir)
_, info = super(SpeculatorModel, DFlashDraftModel).from_pretrained(export_dir, config=config,
                                                                   output_loading_info=True)
config = DFlashSpeculatorConfig.from_pretrained(export_dir)
config.transformer_layer_config._attn_implementation = "eager"  # not saved: chosen at load time
model = DFlashDraftModel.from_pretrained(export_dir, config=config).eval()  # the public path
state = model.state_dict()
written = load_file(f"{export_dir}/model.safetensors")
weights_equal = all(torch.equal(state[k], v) for k, v in written.items())

inputs = torch.load(inputs_path, weights_only=True)
anchors = inputs["anchors"]  # (A,)
dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors, torch.ones_like(anchors, dtype=torch.bool))
ids = inputs["input_ids"]
with torch.no_grad():
    _, logits, _, _, _ = model._backbone_forward(
        inputs["hidden_states"], ids, torch.ones_like(ids), torch.zeros(*ids.shape, config.transformer_layer_config.hidden_size),
        torch.zeros_like(ids), max_anchors=anchors.numel())
torch.save({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "mismatched": sorted(str(m) for m in info["mismatched_keys"]), "weights_equal": weights_equal,
            "mask_token_id": model.mask_token_id, "logits": logits[0]}, out_path)
