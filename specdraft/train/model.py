"""TargetWithDraft: the one module handed to deepspeed.initialize.

State-dict names: the frozen target keeps transformers' names (`model.*`, `lm_head.*`); the only
trainable parameters live under `draft_model.*`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specdraft.drafts.base import Draft, DraftLoss
from specdraft.target.model import target_features

DRAFT_PREFIX = "draft_model."


class TargetWithDraft(nn.Module):
    def __init__(self, target_causal_lm: nn.Module, draft: Draft, loss_chunk_size: int = 1024):
        super().__init__()
        self.model = target_causal_lm.model  # frozen decoder stack (transformers' names)
        self.lm_head = target_causal_lm.lm_head  # frozen, shared with the draft
        self.draft_model = draft
        self.target_config = target_causal_lm.config
        self.loss_chunk_size = loss_chunk_size
        # The whole causal LM, for decoding evals; kept off the module tree so its parameters are
        # not registered (or saved) a second time under another name.
        object.__setattr__(self, "target_lm", target_causal_lm)

    def register_external_parameters_for_zero3(self) -> None:
        """lm_head.weight is read in our forward, not through lm_head's own forward: ZeRO-3
        must be told to gather it there."""
        import deepspeed

        deepspeed.zero.register_external_parameter(self, self.lm_head.weight)

    def decoding_parameters(self) -> list:
        """What decoding reads outside module calls, so ZeRO-3's hooks would not gather it: the
        draft (its drafter may read weights directly) and the lm_head weight the drafter copies."""
        return [*self.draft_model.parameters(), self.lm_head.weight]

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, **options) -> DraftLoss:
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)
        # per-batch options are drawn on the CPU (a seeded CPU generator): move them to the inputs
        position_ids = position_ids.to(input_ids.device).expand(B, T)
        options = {k: v.to(input_ids.device) if torch.is_tensor(v) else v for k, v in options.items()}
        features = target_features(self.model, input_ids, position_ids)
        return self.draft_model.training_loss(features, self.lm_head.weight, input_ids, loss_mask,
                                              self.loss_chunk_size, **options)

    def train(self, mode: bool = True):
        # The target stays in eval mode whatever the engine asks (no dropout in a frozen model).
        super().train(mode)
        self.model.eval()
        return self

    def draft_state_dict(self) -> dict:
        """The draft's weights with the `draft_model.` prefix stripped (LongSpec's extract_and_rename)."""
        return {k: v.detach().clone() for k, v in self.draft_model.state_dict().items()}
