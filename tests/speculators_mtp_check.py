"""Run INSIDE the speculators venv (not ours): load an MTP export with speculators' own class.

    python speculators_mtp_check.py EXPORT_DIR TARGET_DIR INPUTS.pt OUT.pt

Writes transformers' loading info of the file's tensors, whether the loaded weights equal the file,
the config's fields, the per-step logits and the weighted loss of speculators' own
MTPDraftModel.forward (under no_grad, its default step weights beta = 0.6) on the inputs given in
INPUTS.pt (input_ids, the target's final hidden states, loss_mask), and the state dict speculators'
MTPConverter extracts from the target's own mtp.* tensors.
"""

import sys

import torch
from safetensors.torch import load_file

from speculators.convert.mtp.converter import MTPConverter
from speculators.model import SpeculatorModel
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig, compute_step_weights

export_dir, target_dir, inputs_path, out_path = sys.argv[1:5]

config = MTPSpeculatorConfig.from_pretrained(export_dir)
_, info = super(SpeculatorModel, MTPDraftModel).from_pretrained(export_dir, config=config, output_loading_info=True)
model = MTPDraftModel.from_pretrained(export_dir).eval()  # the public path: reads the verifier's embed / lm_head
state = model.state_dict()
written = load_file(f"{export_dir}/model.safetensors")
weights_equal = all(torch.equal(state[k], v) for k, v in written.items())

inputs = torch.load(inputs_path, weights_only=True)
steps = model.config.num_speculative_steps
with torch.no_grad():
    logits, loss, metrics = model(
        inputs["input_ids"],
        inputs["hidden_states"],
        loss_mask=inputs["loss_mask"],
        step_weights=compute_step_weights(0.6, steps),
    )
converted = MTPConverter().convert_to_state_dict(target_dir)
torch.save(
    {
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": sorted(str(m) for m in info["mismatched_keys"]),
        "weights_equal": weights_equal,
        "model_type": config.speculators_model_type,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
        "steps": steps,
        "logits": [x[0] for x in logits],
        "loss": loss,
        "step_losses": [metrics[f"loss_step_{k}"] for k in range(len(logits))],
        "embed_equal_verifier": torch.equal(
            model.embed_tokens.weight, load_file(f"{target_dir}/model.safetensors")["model.embed_tokens.weight"]
        ),
        "converted": converted,
    },
    out_path,
)
