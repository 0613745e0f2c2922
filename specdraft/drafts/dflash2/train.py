"""DFlash2's training (mixed into drafts/dflash2/model.py's DFlash2Draft): DFlash's block loss
(drafts/dflash/train.py, KL by default) plus, at every predicting slot, selector_loss_alpha x the
selector's K-way cross-entropy (speculators 0.9.0, models/dflash2/metrics.py compute_selector_loss):

    candidates  the unary top-K of the slot (the draft's own logits through the target's head)
    label       the target's argmax there; outside the top-K it replaces the weakest candidate
    predecessor the data's token before the slot's (teacher-forced; TrainingBlocks.previous_tokens)
    scores      unary[c] + selector transition(hidden, predecessor, c), CE against the label's place

weighted like the slot's objective (DFlash's exp(-j / gamma)) and summed over the counted rows, so
one mean over the counted tokens holds both, as speculators' loss_function. The target's final
hidden state is always captured: the label is its argmax. Rules the loss keeps: DFlash's."""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from specdraft.drafts.dflash.train import DFlashTraining
from specdraft.drafts.dflash2.selector import training_candidates
from specdraft.drafts.loss import default_chunk_size, whole_vocab_pass


def unary_top_k(student: torch.Tensor, weight: torch.Tensor, k: int, chunk_size: int) -> torch.Tensor:
    """(N, H) rows through the (V, H) head, one (C, V) block at a time, no grad -> (N, k) top ids."""
    chunk = chunk_size if chunk_size > 0 else default_chunk_size(weight.shape[0])
    with torch.no_grad():
        parts = [(part.to(weight.dtype) @ weight.t()).topk(k, dim=-1).indices for part in student.split(chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, k, dtype=torch.long, device=student.device)


class DFlash2Training(DFlashTraining):
    """The training side of DFlash2Draft: DFlash's, plus the selector's term at each slot."""

    def capture_request(self):
        return dataclasses.replace(super().capture_request(), final_hidden=True)

    def head_terms(self, head, slot, rows, student, teacher, lm_head_weight, chunk_size, n, objective_out):
        k = self.dims.selector_top_k
        previous = head.previous_tokens[:, :, slot].flatten()[rows]
        candidates = unary_top_k(student, lm_head_weight, k, chunk_size)
        _, target_ids = whole_vocab_pass(teacher, lm_head_weight, chunk_size, logsumexp=False, argmax=True)
        ids, place, contains = training_candidates(candidates, target_ids)
        # the unary scores of the K candidates: differentiable in the draft's hidden state, as
        # speculators' score_candidates gathers them from its unary logits
        unary = (student[:, None, :].to(lm_head_weight.dtype) * lm_head_weight[ids]).sum(dim=-1)
        scores = self.candidate_selector.score_candidates_of(unary, student, previous, ids)
        ce = F.cross_entropy(scores.float(), place, reduction="sum")
        picked = ids.gather(1, scores.detach().argmax(dim=-1, keepdim=True))[:, 0]
        metrics: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {
            "selector/loss": (ce.detach(), n),
            f"selector/recall_at_{k}": (contains.sum(), n),
            "selector/accuracy": (((picked == target_ids) & contains).sum(), contains.sum()),
        }
        return self.dims.selector_loss_alpha * ce, metrics

    def memory_terms(self, shape):
        terms = super().memory_terms(shape)
        d, p = self.dims, shape.dtype_bytes
        slots = self.trained_blocks(shape) * d.layout.predictions
        # per layer and block slot: the two convolutions' inputs, kernels and outputs (4 H + 4 K H / G);
        # per predicting slot: the K candidates' head rows and codebook rows (K (H + 2 R)); the codebooks' grads
        conv = self.trained_blocks(shape) * d.block_size * d.num_layers * (4 * d.hidden_size) * p
        selector = slots * d.selector_top_k * (d.hidden_size + 2 * d.selector_rank) * p
        terms["DFlash2 convolutions and selector"] = conv + selector + 2 * d.vocab_size * d.selector_rank * 4
        return terms
