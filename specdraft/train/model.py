"""TargetWithDraft: the one module handed to deepspeed.initialize.

State-dict names: the frozen target keeps transformers' names (`model.*`, `lm_head.*`); the only
trainable parameters live under `draft_model.*`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from specdraft.drafts.base import Draft, DraftLoss, HostBatch, LossBatch
from specdraft.target.attention import document_attention
from specdraft.features.step import cached_target_features
from specdraft.parallel.sequence import SequenceParallel, SequenceShard
from specdraft.target.capture import CaptureRequest, TargetFeatures, capture
from specdraft.transfer import to_device


def target_features(
    base_model: nn.Module,
    request: CaptureRequest,
    input_ids: torch.Tensor,
    document_positions: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    shard: Optional[SequenceShard] = None,
    cached: Optional[dict] = None,
    target_config=None,
) -> TargetFeatures:
    """The one target pass of a micro-batch (see TargetWithDraft.forward for the arguments).
    shard: sequence parallelism (the whole batch in, this rank's tokens' features out).
    cached: the batch's features from a feature cache (base_model: the light target, whose
    target_config is the whole target's): no pass, the same TargetFeatures."""
    B, T = input_ids.shape
    if document_positions is None:
        document_positions = torch.arange(T, device=input_ids.device).expand(B, T)
    if position_ids is not None:
        document_positions = to_device(position_ids, input_ids.device)[document_positions]
    if cached is not None:
        return cached_target_features(
            base_model, target_config, request, input_ids, document_positions.expand(B, T), cached, shard
        )
    # causal inside each document, no (T, T) mask (documents.py)
    return capture(
        base_model, input_ids, document_positions.expand(B, T), request, document_attention(document_ids), shard
    )


class TargetWithDraft(nn.Module):
    def __init__(
        self,
        target_causal_lm: nn.Module,
        draft: Draft,
        loss_chunk_size: int = 0,
        sequence_parallel: SequenceParallel = SequenceParallel(),
    ):
        super().__init__()
        self.sequence_parallel = sequence_parallel  # the ranks sharing each sequence (size 1: none)
        self.model = target_causal_lm.model  # frozen decoder stack (transformers' names)
        self.lm_head = target_causal_lm.lm_head  # frozen, shared with the draft
        self.draft_model = draft
        self.target_config = target_causal_lm.config
        self.loss_chunk_size = loss_chunk_size
        # hybrid feature cache (the loop sets it): a live pass's features -> committed to the cache,
        # and trained on as the cache stores them
        self.round_live = None

    def register_external_parameters_for_zero3(self) -> None:
        """lm_head.weight (and any draft weight the draft reads directly) is read in our forward,
        not through its module's own forward: ZeRO-3 must be told to gather it there."""
        import deepspeed

        for param in [self.lm_head.weight, *self.draft_model.external_parameters()]:
            deepspeed.zero.register_external_parameter(self, param)

    def decoding_parameters(self) -> list:
        """What decoding reads outside module calls, so ZeRO-3's hooks would not gather it: the
        draft (its drafter may read weights directly) and the lm_head weight the drafter copies."""
        return [*self.draft_model.parameters(), self.lm_head.weight]

    def forward(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        document_positions: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        host: Optional[HostBatch] = None,
        cached: Optional[dict] = None,
        **options,
    ) -> DraftLoss:
        """document_positions / document_ids (B, T): each token's position inside its document and
        its document (packed data); None: one document per row. position_ids (T,): a draft's
        position map (Anchor-Offset) from a position in the document to the position used.
        host: the same batch on the host, where the loss reads which rows count (no device sync).
        cached: the batch's target features from a feature cache (kind -> (B, T, ...))."""
        features = target_features(
            self.model,
            self.draft_model.capture_request(),
            input_ids,
            document_positions,
            document_ids,
            position_ids,
            self.sequence_parallel.shard(input_ids.shape[1]),
            cached,
            self.target_config,
        )
        if cached is None and self.round_live is not None:
            features = self.round_live(features)
        return self.draft_model.training_loss(
            LossBatch(
                features, self.lm_head.weight, input_ids, loss_mask, self.loss_chunk_size, document_ids, host, options
            )
        )

    def train(self, mode: bool = True):
        # The target stays in eval mode whatever the engine asks (no dropout in a frozen model).
        super().train(mode)
        self.model.eval()
        return self


class DraftWithLoss(nn.Module):
    """The module of one draft's engine in a run of several drafts: the draft and its loss. The
    frozen target lives outside every engine and runs once per micro-batch (target_features with
    the union of the drafts' requests); each draft reads its part of those features."""

    def __init__(self, draft: Draft, loss_chunk_size: int = 0):
        super().__init__()
        self.draft_model = draft
        self.loss_chunk_size = loss_chunk_size

    def register_external_parameters_for_zero3(self) -> None:
        import deepspeed

        for param in self.draft_model.external_parameters():
            deepspeed.zero.register_external_parameter(self, param)

    def decoding_parameters(self) -> list:
        return list(self.draft_model.parameters())  # the target's lm_head is whole outside the engines

    def forward(
        self,
        features: TargetFeatures,
        lm_head_weight: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        document_ids: Optional[torch.Tensor] = None,
        host: Optional[HostBatch] = None,
        **options,
    ) -> DraftLoss:
        return self.draft_model.training_loss(
            LossBatch(features, lm_head_weight, input_ids, loss_mask, self.loss_chunk_size, document_ids, host, options)
        )
