"""DSpark's training (mixed into drafts/dspark/model.py's DSparkDraft): DFlash's block loss
(drafts/dflash/train.py) plus the confidence head's BCE against each slot's acceptance, and the
heads' memory. The target's distribution is always captured: the confidence target reads it."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from specdraft.drafts.loss import default_chunk_size


class DSparkTraining:
    """The training side of DSparkDraft, over DFlash's (DFlashTraining)."""

    def capture_request(self):
        # the confidence target always reads the target's distribution
        return dataclasses.replace(super().capture_request(), final_hidden=True)

    def head_terms(self, head, slot, rows, student, teacher, lm_head_weight, chunk_size, n, objective_out):
        """The confidence BCE at one slot against its acceptance (acceptance_targets), and its
        calibration: Brier score, accuracy at 0.5, the mean predicted and the mean target."""
        logit = head.confidence[:, :, slot].flatten()[rows].float()
        if objective_out.row_tv is not None and self.objective.temperature == self.dims.confidence_temperature:
            # the slot's objective already compared the same two distributions at this temperature
            accepted = (1.0 - objective_out.row_tv).clamp(0.0, 1.0)
        else:
            accepted = acceptance_targets(
                student.detach(),
                head.weight.detach(),
                teacher,
                lm_head_weight,
                self.dims.confidence_temperature,
                chunk_size,
            )
        bce = F.binary_cross_entropy_with_logits(logit, accepted, reduction="sum")
        predicted = logit.detach().sigmoid()
        metrics = {
            "confidence/bce": (bce.detach(), n),
            "confidence/brier": (((predicted - accepted) ** 2).sum(), n),
            "confidence/accuracy": (((predicted >= 0.5) == (accepted >= 0.5)).sum(), n),
            "confidence/predicted": (predicted.sum(), n),
            "confidence/target": (accepted.sum(), n),
        }
        return self.dims.confidence_loss_weight * bce, metrics

    def memory_terms(self, shape):
        terms = super().memory_terms(shape)
        d, p = self.dims, shape.dtype_bytes
        # the head's (V, H + r) weight; per predicting slot markov_w2's fp32 (V, r) gradient, made
        # in the forward pass and kept to the backward (chunked_objective's weight_tail); per block
        # slot the Markov and confidence features
        terms["DSpark heads"] = (
            d.vocab_size * (d.hidden_size + d.markov_rank) * p
            + self.layout.predictions * d.vocab_size * d.markov_rank * 4
            + self.trained_blocks(shape) * d.block_size * 4 * (d.hidden_size + d.markov_rank) * p
        )
        return terms


@torch.no_grad()
def acceptance_targets(
    student: torch.Tensor,
    weight: torch.Tensor,
    teacher: torch.Tensor,
    teacher_weight: torch.Tensor,
    temperature: float,
    chunk_size: int,
) -> torch.Tensor:
    """(N,) float32: would each row's drafted token be accepted? student @ weight.T are the draft's
    logits, teacher @ teacher_weight.T the target's. temperature > 0: speculative sampling's
    acceptance probability there, sum_v min(p_v, q_v) = 1 - TV(p, q); 0: greedy, 1 where the
    two argmaxes agree. Chunked: no (N, V) tensor."""
    chunk = chunk_size if chunk_size > 0 else default_chunk_size(weight.shape[0])
    out = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
    for start in range(0, student.shape[0], chunk):
        rows = slice(start, start + chunk)
        z = (student[rows] @ weight.t().to(student.dtype)).float()
        t = (teacher[rows].to(teacher_weight.dtype) @ teacher_weight.t()).float()
        if temperature == 0:
            out[rows] = (z.argmax(dim=-1) == t.argmax(dim=-1)).float()
        else:
            q, p = torch.softmax(z / temperature, dim=-1), torch.softmax(t / temperature, dim=-1)
            out[rows] = torch.minimum(p, q).sum(dim=-1).clamp(0.0, 1.0)
    return out
