"""GLIDE's training (mixed into drafts/glide/model.py's GlideDraft): the lag drawn per batch, the
loss over the positions that had target context, and the memory one micro-batch keeps.

Rules the loss keeps (docs/architecture.md): which rows count is decided on the host (no device
sync); under sequence parallelism each rank holds T/N tokens and the mean is over the whole
sequence's counted tokens; packed documents confine both attentions and the labels."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from specdraft.drafts.base import CaptureRequest, DraftLoss, LossBatch, MemoryShape, document_starts, rows_where
from specdraft.drafts.layers import window_mask_elements
from specdraft.drafts.objectives import answer_labels, shared_head_objective, term_metrics


class GlideTraining:
    """The training side of GlideDraft."""

    def capture_request(self) -> CaptureRequest:
        # the final hidden state only when the objective reads the target's distribution
        return CaptureRequest(last_layer_kv=True, final_hidden=self.objective.needs_teacher)

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, Any]:
        lag = int(torch.randint(1, self.dims.max_lag + 1, (1,), generator=generator))
        options: Dict[str, Any] = {"lag": lag}
        if self.dims.anchor_offset:
            options["position_ids"] = anchor_offset_positions(
                seq_len, self.dims.max_sink_tokens, self.dims.max_position_offset, generator
            )
        return options

    def training_loss(self, batch: LossBatch) -> DraftLoss:
        """Each position t predicts token t+1 reading the target's K/V up to t - lag; packed
        documents keep attention and labels inside each one."""
        features, input_ids, lag = batch.features, batch.input_ids, batch.options.get("lag", 1)
        hidden = self.forward_sequence(
            features.input_embeds,
            features.cos,
            features.sin,
            features.last_keys,
            features.last_values,
            lag,
            batch.documents,
            features.shard,
        )
        shard, host = batch.shard, batch.on_host()
        counted = counted_predictions(self.objective.taught(host.loss_mask, host.token_mask), host.documents, lag)
        group_tokens = shard.host_count(counted)  # on the host: the whole sequence's, every rank alike
        counted = shard.local(counted)
        rows, tokens = rows_where(counted, input_ids.device)
        predictions = hidden.flatten(0, 1)[rows]  # row b*T + t predicts token t+1 of row b
        labels = shard.local(F.pad(input_ids[:, 1:], (0, 1))).flatten()[rows]  # token t+1 at t
        next_is_answer = torch.zeros_like(host.loss_mask, dtype=torch.bool)  # on the host: is token t+1 an answer
        next_is_answer[:, :-1] = host.loss_mask[:, 1:].bool()
        ce_labels, answers = answer_labels(labels, shard.local(next_is_answer)[counted])  # CE learns answers only
        # the teacher: the target's own next-token distribution at t, from its final hidden state
        teacher = features.final_hidden.flatten(0, 1)[rows] if self.objective.needs_teacher else None
        objective = self.objective.over_rows(rows.numel(), answers)
        out = shared_head_objective(predictions, batch.lm_head_weight, teacher, ce_labels, objective, batch.chunk_size)
        correct = out.correct if ce_labels is labels else (out.argmax == labels).sum()  # vs the data's token
        loss, weight = shard.token_mean(out.loss, group_tokens, tokens)
        return DraftLoss(loss=loss, tokens=weight, correct=correct, metrics=term_metrics(out.terms, tokens, answers))

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        d, p, tokens = self.dims, shape.dtype_bytes, shape.B * shape.T
        H, heads, kv, hd, I = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
        terms = {
            # input embeddings (H), cos/sin (2 hd), the target's last-layer K/V (2 kv hd)
            "capture features": shape.capture_features(H + 2 * hd + 2 * d.target_kv_heads * hd),
            # saved per token: 10 H-sized tensors (norm in/out, residuals, o_proj / cross / MLP
            # outputs), q/k/v + RoPE copies + attention outputs (self 4 heads hd + 3 kv hd, cross
            # 3 heads hd), MLP gate/up/silu/product (4I); the 3 RMSNorms keep their inputs in fp32
            "draft activations": tokens
            * ((10 * H + 7 * heads * hd + 3 * kv * hd + 4 * I) * p + shape.fp32_norm_inputs(3 * H)),
            "loss chunk + hidden grads": shape.loss_chunk(
                tokens, shape.target.vocab_size, H, teacher=self.objective.needs_teacher
            ),
        }
        # one conversation per row longer than the window: the self-attention's band mask
        # (layers.sliding_window_attention), as the float bias SDPA makes of it and keeps for the
        # backward. It spans the whole sequence under SP: the core attends every token with the
        # rank's heads. Packed documents add no term: per-conversation slices on CPU, flex block
        # masks on CUDA (O(T^2 / 128^2) block indices), drafts/layers.py
        band = 0 if shape.documents else window_mask_elements(shape.B, shape.context_T, d.sliding_window)
        if band:
            terms["window mask"] = band * p
        return terms


def counted_predictions(loss_mask: torch.Tensor, documents: Optional[torch.Tensor], lag: int) -> torch.Tensor:
    """(B, T) bool: the positions t whose prediction of token t+1 the loss counts. Token t+1 is
    loss-masked and in t's document, and t had target context: t - lag is in its document."""
    B, T = loss_mask.shape
    index = torch.arange(T, device=loss_mask.device)
    counted = torch.zeros(B, T, dtype=torch.bool, device=loss_mask.device)
    if documents is None:
        counted[:, :-1] = loss_mask[:, 1:].bool() & (index[None, :-1] >= lag)
        return counted
    start_index = document_starts(documents)  # (B, T) its document's first token
    has_context = index - lag >= start_index
    same_document = start_index[:, 1:] == start_index[:, :-1]
    counted[:, :-1] = loss_mask[:, 1:].bool() & has_context[:, :-1] & same_document  # label in t's document
    return counted


def anchor_offset_positions(seq_len: int, max_sink: int, max_offset: int, generator: torch.Generator) -> torch.Tensor:
    """Anchor-Offset position ids: s sink positions 0..s-1, the rest shifted by a random offset."""
    sinks = int(torch.randint(0, max_sink + 1, (1,), generator=generator))
    offset = int(torch.randint(0, max_offset + 1, (1,), generator=generator))
    positions = torch.arange(seq_len, device="cpu")  # drawn on the host; TargetWithDraft moves it
    positions[sinks:] += offset
    return positions
