"""Run INSIDE the speculators venv (not ours): load a DFlash2 export with speculators' own class.

    python speculators_dflash2_check.py EXPORT_DIR INPUTS.pt OUT.pt

Writes transformers' loading info of the file's tensors, whether the loaded weights equal the file,
the config's convolution and selector fields, and speculators' own DFlash2DraftModel.forward's unary
logits and the selector's scores of its training candidates (eager attention, under no_grad) at the
anchors given in INPUTS.pt: captured where forward hands them to its loss (compute_metrics), so every
step of its convolutions and selector wiring is speculators' own.
"""

import sys

import torch

import speculators.models.dflash2.core as dflash2_core
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
from speculators_block_export import inputs_at_fixed_anchors, load_export

export_dir, inputs_path, out_path = sys.argv[1:4]

model, config, loaded = load_export(export_dir, DFlash2DraftModel, DFlash2SpeculatorConfig)
inputs = inputs_at_fixed_anchors(inputs_path)
seen = {}


def capture(*, unary_logits, training_candidate_ids, candidate_logits, **kwargs):
    seen.update(logits=unary_logits[0], ids=training_candidate_ids[0], scores=candidate_logits[0])
    return torch.zeros(()), {}


dflash2_core.compute_metrics = capture
ids = inputs["input_ids"]
with torch.no_grad():
    model(
        inputs["hidden_states"],
        ids,
        torch.ones_like(ids),
        inputs["final_hidden"],
        torch.zeros_like(ids),
        max_anchors=inputs["anchors"].numel(),
    )
torch.save(
    {
        **loaded,
        "fields": [config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k],
        **seen,
    },
    out_path,
)
