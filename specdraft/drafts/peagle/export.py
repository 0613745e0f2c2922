"""P-EAGLE in speculators' format (PEagleSpeculatorConfig / PEagleDraftModel, speculators 0.9.0):
EAGLE-3's config and keys (drafts/eagle3/export.py) with speculators_model_type "peagle",
architectures ["PEagleSpeculator"], algorithm "peagle", mask_token_id, embed_requires_grad true,
speculative_tokens K, plus mask_hidden [1, 1, 3 Ht]; embed_tokens.weight is the target's with
the mask token's row replaced by the trained mask_embedding.

vLLM serves it as method eagle3 with parallel_drafting: its speculators config reader maps
mask_token_id to the proposer's pard_token (vllm/transformers_utils/configs/speculators/algos.py,
update_peagle: `pre_trained_config["pard_token"] = config_dict["mask_token_id"]`; architectures
PeagleLlamaForCausalLM), so mask_token_id is always written.

SGLang: no P-EAGLE format. sgl-project/sglang's python/sglang/srt/speculative/spec_info.py
(SpeculativeAlgorithm) names EAGLE / EAGLE3 / DFLASH / … but no parallel-drafting EAGLE, and no
P-EAGLE worker or mask-token reader is in that folder (checked for issue 35); an SGLang export of
the EAGLE-3 layer would serve only depth 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

import torch

from specdraft.drafts.base import FileFormat, config_fields
from specdraft.drafts.eagle3 import export as eagle3_export
from specdraft.drafts.eagle3.export import (
    SPECULATORS_SETTINGS,
    speculators_config,
    speculators_implied,
    speculators_state_dict,
)
from specdraft.errors import SpecdraftError

# speculators' config field -> the draft key it records (an import checks them); its P-EAGLE
# forward reads lm_head(norm(out)) whatever norm_output says (one layer pass), so that one is moot
PEAGLE_SETTINGS = {
    **{k: v for k, v in SPECULATORS_SETTINGS.items() if k != "norm_output"},
    "mask_token_id": "mask_token_id",
}
OURS_ONLY = ("mask_embedding",)  # written into embed_tokens' mask row, not under its own name


def peagle_config(draft, target_dir: str) -> Dict:
    config = speculators_config(draft, target_dir)
    config.update(
        speculators_model_type="peagle",
        architectures=["PEagleSpeculator"],
        mask_token_id=int(draft.dims.mask_token_id),
        embed_requires_grad=True,
    )
    config["speculators_config"]["algorithm"] = "peagle"
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = int(draft.dims.num_depths)
    return config


def peagle_state_dict(draft, state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in speculators_state_dict(draft, state_dict).items() if k not in OURS_ONLY}


def with_mask_row(draft, state_dict: Dict[str, torch.Tensor], embed_tokens: torch.Tensor) -> torch.Tensor:
    """The target's embed_tokens with the mask token's row replaced by the trained mask_embedding."""
    embed = embed_tokens.clone()
    embed[draft.dims.mask_token_id] = state_dict["mask_embedding"].to(embed.dtype)
    return embed


def write_speculators(draft, state_dict: Dict[str, torch.Tensor], out_dir: Path, target_dir: str) -> None:
    eagle3_export.write_speculators(
        draft, state_dict, out_dir, target_dir, config=peagle_config, state=peagle_state_dict, embeddings=with_mask_row
    )


def mask_row(draft, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """An import reads the trained mask embedding back out of embed_tokens (the mask token's row)."""
    if "embed_tokens.weight" not in tensors:
        raise SpecdraftError(
            "a speculators P-EAGLE draft without embed_tokens.weight: its mask token's "
            "embedding (a trained row) is missing"
        )
    return {"mask_embedding": tensors["embed_tokens.weight"][int(draft.dims.mask_token_id)].clone()}


FILE_FORMATS = {
    "speculators": FileFormat(peagle_state_dict, config_fields(PEAGLE_SETTINGS), speculators_implied, derived=mask_row)
}
