"""Run INSIDE the speculators venv (not ours), imported by speculators_dflash_check.py and
speculators_dspark_check.py: a block-draft export loaded with speculators' own classes, and its
anchors fixed to the ones our forward used."""

import torch
from safetensors.torch import load_file

import speculators.models.dflash.core as dflash_core
from speculators.model import SpeculatorModel


def load_export(export_dir, model_class, config_class):
    """(the model, eval, eager attention; its config; {"missing", "unexpected", "mismatched"}:
    transformers' loading info of the file's tensors, and "weights_equal": the loaded weights
    equal the file's)."""
    config = config_class.from_pretrained(export_dir)
    _, info = super(SpeculatorModel, model_class).from_pretrained(export_dir, config=config, output_loading_info=True)
    config = config_class.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # not saved: chosen at load time
    model = model_class.from_pretrained(export_dir, config=config).eval()  # the public path
    state = model.state_dict()
    written = load_file(f"{export_dir}/model.safetensors")
    return (
        model,
        config,
        {
            "missing": sorted(info["missing_keys"]),
            "unexpected": sorted(info["unexpected_keys"]),
            "mismatched": sorted(str(m) for m in info["mismatched_keys"]),
            "weights_equal": all(torch.equal(state[k], v) for k, v in written.items()),
        },
    )


def inputs_at_fixed_anchors(inputs_path) -> dict:
    """INPUTS.pt, with speculators' anchor selection replaced by its anchors (A,)."""
    inputs = torch.load(inputs_path, weights_only=True)
    anchors = inputs["anchors"]
    dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (
        anchors,
        torch.ones_like(anchors, dtype=torch.bool),
    )
    return inputs
