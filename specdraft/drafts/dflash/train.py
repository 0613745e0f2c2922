"""DFlash's training (mixed into drafts/dflash/model.py's DFlashBackbone, so DSpark trains alike):
the anchors drawn per batch, every block of every row in one forward, the decayed (or D-PACE
weighted) objective over each block's predictions, and the memory one micro-batch keeps.

Rules the loss keeps (docs/architecture.md): the anchors are drawn on the host copy of the batch,
from the batch's seed (exact resume, no device sync); under sequence parallelism each rank trains
the blocks anchored in its T/N tokens over the all-gathered context, and the mean is over the
whole sequence's counted tokens; packed documents keep every block inside its own conversation."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from specdraft.drafts.base import CaptureRequest, DraftLoss, LossBatch, MemoryShape, TargetFeatures, rows_where
from specdraft.drafts.dflash.blocks import (
    BlockVisibility,
    TrainingBlocks,
    loss_weights,
    own_blocks,
    sample_training_blocks,
)
from specdraft.drafts.dflash.layer import BlockHead
from specdraft.target.attention import attention_path
from specdraft.drafts.loss import chunked_cross_entropy, row_cross_entropy
from specdraft.drafts.objectives import (
    ObjectiveSums,
    answer_labels,
    chunked_objective,
    dpace_weights,
    shared_head_objective,
    term_metrics,
)
from specdraft.parallel.sequence import SequenceShard


class DFlashTraining:
    """The training side of DFlash's backbone (DSparkTraining adds its head's terms)."""

    def capture_request(self) -> CaptureRequest:
        return CaptureRequest(
            layers=tuple(sorted(self.dims.target_layers)),
            token_embeddings=(self.dims.mask_token_id,),
            final_hidden=self.objective.needs_teacher,
        )

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, Any]:
        return {"anchor_seed": int(torch.randint(0, 2**62, (1,), generator=generator))}

    def training_blocks(self, input_ids, loss_mask, anchor_seed: int, documents=None) -> TrainingBlocks:
        return sample_training_blocks(input_ids, loss_mask, self.layout, self.dims.max_anchors, anchor_seed, documents)

    def training_hidden(self, features: TargetFeatures, blocks: TrainingBlocks) -> torch.Tensor:
        """The vectorised training forward: every block of every row at once -> (B, A, S, H).
        Sequence parallelism (features.shard): `blocks` are this rank's (anchors in its tokens);
        the context is all-gathered once (differentiable), every layer's keys/values made from it:
        block queries are not sequence positions, so there is no head exchange to make here."""
        B, A = blocks.anchors.shape
        shard = features.shard or SequenceShard.whole(features.input_embeds.shape[1])
        context = shard.gather(self.context(features.hidden))  # (B, T, H) the whole sequence
        context_kv = self.context_keys_values(context, shard.gather(features.cos), shard.gather(features.sin))
        T = context.shape[1]
        anchor_embeds = features.input_embeds.gather(
            1, (blocks.anchors - shard.start)[..., None].expand(B, A, features.input_embeds.shape[-1])
        )
        positions = shard.gather(features.position_ids.expand(B, shard.local_length))
        cos, sin = features.rotary(blocks.slot_positions(positions).flatten(1))
        hidden = self(
            anchor_embeds,
            features.token_embeds[0],
            cos,
            sin,
            context_kv,
            BlockVisibility(blocks.anchors, T, self.layout.block_size, blocks.context_start),
        )
        return hidden.view(B, A, self.layout.block_size, -1)

    def training_loss(self, batch: LossBatch) -> DraftLoss:
        """Up to max_anchors blocks per row, drawn from the batch's anchor seed; their predictions
        weighted by the decay (or D-PACE), one mean over the counted tokens."""
        features, input_ids = batch.features, batch.input_ids
        host = batch.on_host()
        # on the host; anchors among every token when the teacher terms learn them all
        host_blocks = self.training_blocks(
            host.input_ids,
            self.objective.taught(host.loss_mask, host.token_mask),
            batch.options.get("anchor_seed", 0),
            host.documents,
        )
        shard = batch.shard
        group_tokens = shard.host_count(host_blocks.counted)  # on the host: the whole sequence's, every rank alike
        host_blocks = own_blocks(host_blocks, shard, static=attention_path(input_ids.device) == "flex")
        if host_blocks.anchors.shape[1] == 0:  # a row too short for one block: nothing to learn
            none = torch.zeros((), dtype=torch.long, device=input_ids.device)
            metrics = {
                f"block_{j + 1}/{name}": (none.float(), none)
                for j in range(self.layout.predictions)
                for name in ("loss", "accuracy")
            }  # the same names as every other batch
            return DraftLoss(loss=self.fc.weight.sum() * 0.0, tokens=none, correct=none.clone(), metrics=metrics)
        blocks = host_blocks.to(input_ids.device)
        hidden = self.training_hidden(features, blocks)
        label_is_answer = (
            host.loss_mask.gather(1, host_blocks.label_positions.flatten(1)).view_as(host_blocks.counted).bool()
        )
        final_hidden = features.final_hidden
        if final_hidden is not None and shard.parallel:  # the teacher of a block's last label may be on the next rank
            final_hidden = shard.extend_right(final_hidden, self.layout.span)
        return self.block_loss(
            hidden,
            blocks,
            host_blocks.counted,
            label_is_answer,
            batch.lm_head_weight,
            batch.chunk_size,
            final_hidden,
            blocks.previous_tokens(input_ids, self.layout.first_slot),
            shard=shard,
            group_tokens=group_tokens,
        )

    def block_loss(
        self,
        hidden,
        blocks: TrainingBlocks,
        counted: torch.Tensor,
        label_is_answer: torch.Tensor,
        lm_head_weight,
        chunk_size: int,
        final_hidden: Optional[torch.Tensor] = None,
        previous_tokens: Optional[torch.Tensor] = None,
        shard: Optional[SequenceShard] = None,
        group_tokens: Optional[int] = None,
    ) -> DraftLoss:
        """Weighted objective of each block's predictions: sum_j w_j * objective_j / counted tokens
        (speculators' normalisation). hidden (B, A, S, H); counted (B, A, P) bool on the host;
        final_hidden (B, T, Ht): the target's, when the objective reads its distribution (the
        teacher of the token at anchor + 1 + j is the target's output at anchor + j);
        label_is_answer (B, A, P) bool on the host: the labels CE learns (answer tokens);
        previous_tokens (B, A, S): each slot's previous token, for the head (block_head).
        shard, group_tokens: sequence parallelism, final_hidden is this rank's tokens (then the
        next ranks' first span), the loss this rank's share of the group's (SequenceShard.token_mean)."""
        B, A = blocks.anchors.shape
        first = self.layout.first_slot
        weights = loss_weights(self.layout, self.dims.loss_decay_gamma)
        device = hidden.device
        if final_hidden is not None:  # each block's anchor as a row of final_hidden.flatten(0, 1)
            start = 0 if shard is None else shard.start  # final_hidden's first token
            anchor_rows = (
                torch.arange(B, device=device)[:, None] * final_hidden.shape[1] + blocks.anchors - start
            ).flatten()
        total = hidden.new_zeros((), dtype=torch.float32)
        tokens = torch.zeros((), dtype=torch.long, device=device)
        correct = torch.zeros((), dtype=torch.long, device=device)
        metrics: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        head = self.block_head(hidden, previous_tokens, self.head_weight(lm_head_weight))  # (B, A, S, F)
        dpace = (
            self.dpace_row_weights(head, blocks, counted, chunk_size) if self.dims.loss_weighting == "dpace" else None
        )
        for j in range(self.layout.predictions):
            slot = counted[..., j]
            rows, n = rows_where(slot, device)  # over the (B * A) blocks
            teacher = None if final_hidden is None else final_hidden.flatten(0, 1)[anchor_rows[rows] + j]
            labels = blocks.labels[..., j].flatten()[rows]
            ce_labels, answers = answer_labels(labels, label_is_answer[..., j][slot])  # CE learns answers only
            student = head.features[:, :, first + j].flatten(0, 1)[rows]
            objective = self.objective.over_rows(rows.numel(), answers)
            if dpace is not None:  # CE only (validate_config): each row weighted by D-PACE, no decay
                out = dpace_slot_loss(student, head.weight, lm_head_weight, labels, dpace[:, j][rows], chunk_size)
            elif head.weight is lm_head_weight:  # the target's own head: its cheapest path
                out = shared_head_objective(student, lm_head_weight, teacher, ce_labels, objective, chunk_size)
            else:  # a head of the draft's own: the teacher is still the target's lm_head
                out = chunked_objective(
                    student,
                    head.weight,
                    teacher,
                    lm_head_weight,
                    ce_labels,
                    objective,
                    chunk_size,
                    weight_tail=head.trained_tail,
                )
            hits = out.correct if ce_labels is labels else (out.argmax == labels).sum()  # vs the data's token
            extra, extra_metrics = self.head_terms(
                head, first + j, rows, student, teacher, lm_head_weight, chunk_size, n, out
            )
            if dpace is not None:  # D-PACE's weights are inside out.loss; gamma weighs only a head's own term
                total = total + out.loss + weights[j] * extra
            else:
                total = total + weights[j] * (out.loss + extra)
            for name, (value, count) in extra_metrics.items():
                term_sum, seen = metrics.get(name, (0.0, 0))
                metrics[name] = (term_sum + value, seen + count)
            tokens, correct = tokens + n, correct + hits
            metrics[f"block_{j + 1}/loss"] = (out.loss.detach(), n)  # (numerator, denominator)
            metrics[f"block_{j + 1}/accuracy"] = (hits, n)
            for name, (value, count) in term_metrics(out.terms, n, answers).items():  # over every block slot
                term_sum, seen = metrics.get(name, (0.0, 0))
                metrics[name] = (term_sum + value, seen + count)
        shard = shard or SequenceShard.whole(final_hidden.shape[1] if final_hidden is not None else 1)
        loss, weight = shard.token_mean(total, group_tokens, tokens)
        return DraftLoss(loss=loss, tokens=weight, correct=correct, metrics=metrics)

    def dpace_row_weights(
        self, head: BlockHead, blocks: TrainingBlocks, counted: torch.Tensor, chunk_size: int
    ) -> torch.Tensor:
        """(B*A, P) D-PACE weights of the blocks' predicting slots from their CE (a no-grad head pass)."""
        first, device = self.layout.first_slot, head.features.device
        mask = counted.flatten(0, 1)  # (B*A, P) on the host
        ce = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        for j in range(self.layout.predictions):
            rows, _ = rows_where(counted[..., j], device)
            slot = head.features[..., first + j, :].flatten(0, 1)
            ce[rows, j] = row_cross_entropy(slot[rows], head.weight, blocks.labels[..., j].flatten()[rows], chunk_size)
        return dpace_weights(ce, mask.to(device), self.dims.dpace_alpha)

    def head_terms(
        self,
        head: BlockHead,
        slot: int,
        rows: torch.Tensor,
        student: torch.Tensor,
        teacher: Optional[torch.Tensor],
        lm_head_weight: torch.Tensor,
        chunk_size: int,
        n: torch.Tensor,
        objective_out: ObjectiveSums,
    ) -> Tuple[Any, Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
        """A head's own loss at one slot, summed over its counted rows (weighted like the slot's
        objective), and its metrics {name: (sum, count)}; objective_out: the slot's objective (its
        per-row tv). DFlash's head has none."""
        return 0.0, {}

    def trained_blocks(self, shape: MemoryShape) -> int:
        """Blocks trained at once: up to max_anchors per sequence. Under SP the anchors are drawn
        over the whole sequence and a rank trains the valid ones in its shard (own_blocks): not its
        even share T / whole_T but up to all of them, where the answers sit in one shard (a long
        prompt first). The busiest rank sets the peak, so the bound: min(max_anchors, T) per rank,
        T its shard (an anchor is one of its tokens; the sampler's padding is not kept)."""
        return shape.B * min(self.dims.max_anchors, shape.T)

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        d, p = self.dims, shape.dtype_bytes
        H, heads, kv, hd, I = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
        context = shape.B * shape.context_T  # every position is context (all-gathered under SP)
        blocks = self.trained_blocks(shape)
        block = blocks * d.block_size  # their slots
        teacher = d.target_hidden_size if self.objective.needs_teacher else 0
        # per slot and layer, saved for backward (counted with saved_tensors_hooks at fp32): the two
        # norms' inputs, normalised outputs and outputs (6 H), q_proj's output, its normalised and
        # rotated queries, the attention output (4 heads hd), k_proj's output and its normalised
        # keys (2 kv hd), MLP gate/up/act/product (4I); the 4 norms (2 H-sized, q_norm, k_norm)
        # keep their inputs in fp32
        per_slot = (6 * H + 4 * heads * hd + 2 * kv * hd + 4 * I) * p + shape.fp32_norm_inputs(
            2 * H + heads * hd + kv * hd
        )
        layers = 1 if self.gradient_checkpointing else d.num_layers  # whose activations are held at once
        terms = {
            # the captured layers (n Ht), input embeddings (H), cos/sin (2 hd), the final hidden
            # state when a teacher is read
            "capture features": shape.capture_features(
                len(d.target_layers) * d.target_hidden_size + H + 2 * hd + teacher
            ),
            # the context: fc's output and its norm (2H), per layer its keys/values with k_norm and
            # RoPE copies (4 kv hd) and their copy in cat(context, block) (2 kv hd); the block
            # slots: per layer a decoder layer's saved tensors and their keys/values in that cat
            # (checkpointed: each layer keeps its input, and one layer comes back at a time)
            "draft activations": context * (2 * H + d.num_layers * 6 * kv * hd) * p
            + block
            * (
                layers * (per_slot + 2 * kv * hd * p)
                + 2 * H * p
                + (d.num_layers * H * p if self.gradient_checkpointing else 0)
            ),
            # one loss call per predicting slot, over that slot of every block
            "loss chunk + hidden grads": shape.loss_chunk(
                blocks * d.layout.predictions,
                d.vocab_size,
                H,
                teacher=self.objective.needs_teacher,
                calls=d.layout.predictions,
            ),
            # which keys each block slot sees, dense for SDPA off GPU: (B, 1, A S, T + A S) bools,
            # and per layer the float bias SDPA makes of it, kept for the backward
            "block mask": block * (shape.context_T + block // shape.B) * (1 + 4 * layers),
        }
        # packed documents add no term: the same-conversation rule is part of the block mask (on
        # CPU each conversation's blocks over its own context, smaller than the term above)
        return terms


def dpace_slot_loss(student, head_weight, lm_head_weight, labels, row_weights, chunk_size: int) -> ObjectiveSums:
    """sum_r w_r CE_r of one slot's rows. The target's frozen head: the chunked CE. A head of the
    draft's own (DSpark's [lm_head | markov_w2]) has a gradient of its own: plain autograd over the
    slot's (rows, V) logits (not chunked: this path holds them until backward)."""
    if head_weight is lm_head_weight:
        total, hits = chunked_cross_entropy(student, lm_head_weight, labels, chunk_size, row_weights)
        return ObjectiveSums(total, hits, {}, argmax=None)
    logits = (student @ head_weight.t().to(student.dtype)).float()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return ObjectiveSums((ce * row_weights).sum(), (logits.argmax(-1) == labels).sum(), {}, argmax=logits.argmax(-1))
