"""Run INSIDE the speculators venv (not ours): load a DSpark export with speculators' own class.

    python speculators_dspark_check.py EXPORT_DIR INPUTS.pt OUT.pt

Writes {"missing", "unexpected", "mismatched"} (transformers' loading info of the file's
tensors), whether the loaded weights equal the file, the config's head fields, and the Markov-biased
logits and the confidence logits of speculators' own DSparkDraftModel.forward (eager attention,
under no_grad) at the anchors given in INPUTS.pt: captured where forward hands them to its loss
(compute_metrics), so every step of its head wiring is speculators' own.
"""

import sys

import torch
from safetensors.torch import load_file

import speculators.models.dflash.core as dflash_core
import speculators.models.dspark.core as dspark_core
from speculators.model import SpeculatorModel
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

export_dir, inputs_path, out_path = sys.argv[1:4]

config = DSparkSpeculatorConfig.from_pretrained(export_dir)
_, info = super(SpeculatorModel, DSparkDraftModel).from_pretrained(export_dir, config=config,
                                                                   output_loading_info=True)
config = DSparkSpeculatorConfig.from_pretrained(export_dir)
config.transformer_layer_config._attn_implementation = "eager"  # not saved: chosen at load time
model = DSparkDraftModel.from_pretrained(export_dir, config=config).eval()  # the public path
state = model.state_dict()
written = load_file(f"{export_dir}/model.safetensors")
weights_equal = all(torch.equal(state[k], v) for k, v in written.items())

inputs = torch.load(inputs_path, weights_only=True)
anchors = inputs["anchors"]  # (A,)
dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors, torch.ones_like(anchors, dtype=torch.bool))
seen = {}


def capture(logits, targets, confidence_logits, *args, **kwargs):
    seen["logits"], seen["confidence"] = logits[0], confidence_logits[0]
    return torch.zeros(()), {}


dspark_core.compute_metrics = capture
ids = inputs["input_ids"]
with torch.no_grad():
    model(inputs["hidden_states"], ids, torch.ones_like(ids),
          torch.zeros(*ids.shape, config.transformer_layer_config.hidden_size), torch.zeros_like(ids),
          max_anchors=anchors.numel())
torch.save({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
            "mismatched": sorted(str(m) for m in info["mismatched_keys"]), "weights_equal": weights_equal,
            "markov_head_type": config.markov_head_type, "markov_rank": config.markov_rank,
            "with_markov": config.confidence_head_with_markov,
            "logits": seen["logits"], "confidence": seen["confidence"]}, out_path)
