"""What the configuration knows of DFlash2 without building it (no torch): DFlash's backbone keys
plus the convolutions' and the selector's (speculators 0.9.0, models/dflash2/config.py defaults),
and their checks. The model is model.py's DFlash2Draft, which inherits DFlash2Spec."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.drafts.dflash.options import DFlashBackboneSpec, DFlashOptions
from specdraft.drafts.spec import option_failure, target_text_config


@dataclass
class DFlash2Options(DFlashOptions):
    """The `draft.` keys DFlash2 reads: DFlash's plus its convolutions' and selector's (draft.loss
    defaults to kl, speculators' DFlash2 objective)."""

    conv_kernel_size: int = 2  # causal taps of each local convolution, inside a block
    conv_group_size: int = 16  # hidden channels sharing one dynamic kernel (hidden size % it == 0)
    selector_rank: int = 256  # rank of the selector's codebooks
    selector_top_k: int = 16  # unary candidates the selector reranks (<= block size, as servers read)
    selector_loss_alpha: float = 1.0  # weight of the selector's K-way cross-entropy


class DFlash2Spec(DFlashBackboneSpec):
    family = "dflash2"
    base_family = "dflash"  # its folder imports dflash/'s
    label = "DFlash2"
    options = DFlash2Options
    default_loss = "kl"

    @classmethod
    def validate_config(cls, draft_cfg, target_config, source: str, max_seq_length: int) -> None:
        super().validate_config(draft_cfg, target_config, source, max_seq_length)
        fail = option_failure(source)
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(draft_cfg[key]) < 1:
                fail(key, f"must be >= 1, got {draft_cfg[key]}")
        if int(draft_cfg.conv_kernel_size) > int(draft_cfg.block_size):
            fail("conv_kernel_size", f"must be <= block_size ({draft_cfg.block_size}): a tap stays inside its block")
        if not float(draft_cfg.selector_loss_alpha) >= 0:
            fail("selector_loss_alpha", f"must be >= 0, got {draft_cfg.selector_loss_alpha}")
        if target_config is None:
            return
        text = target_text_config(target_config)
        if text.hidden_size % int(draft_cfg.conv_group_size):
            fail(
                "conv_group_size",
                f"{draft_cfg.conv_group_size} does not divide the hidden size {text.hidden_size}",
            )
        if int(draft_cfg.selector_top_k) > text.vocab_size:
            fail("selector_top_k", f"must be <= the vocabulary ({text.vocab_size}), got {draft_cfg.selector_top_k}")
