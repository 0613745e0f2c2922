"""D-PACE in a block drafter's loss: one slot's rows weighted by `objectives.dpace_weights`."""

import torch

from specdraft.drafts.loss import chunked_cross_entropy, row_cross_entropy
from specdraft.drafts.objectives import ObjectiveSums

__all__ = ["dpace_slot_loss", "row_cross_entropy"]


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
