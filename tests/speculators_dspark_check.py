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

import speculators.models.dspark.core as dspark_core
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators_block_export import inputs_at_fixed_anchors, load_export

export_dir, inputs_path, out_path = sys.argv[1:4]

model, config, loaded = load_export(export_dir, DSparkDraftModel, DSparkSpeculatorConfig)
inputs = inputs_at_fixed_anchors(inputs_path)
seen = {}


def capture(logits, targets, confidence_logits, *args, **kwargs):
    seen["logits"], seen["confidence"] = logits[0], confidence_logits[0]
    return torch.zeros(()), {}


dspark_core.compute_metrics = capture
ids = inputs["input_ids"]
with torch.no_grad():
    model(
        inputs["hidden_states"],
        ids,
        torch.ones_like(ids),
        torch.zeros(*ids.shape, config.transformer_layer_config.hidden_size),
        torch.zeros_like(ids),
        max_anchors=inputs["anchors"].numel(),
    )
torch.save(
    {
        **loaded,
        "markov_head_type": config.markov_head_type,
        "markov_rank": config.markov_rank,
        "with_markov": config.confidence_head_with_markov,
        "logits": seen["logits"],
        "confidence": seen["confidence"],
    },
    out_path,
)
