"""SpecForge's LK losses (`specforge/core/lk_loss.py`): the formulas on whole (rows, vocab) tensors
(the reference: acceptance_rate, lk_loss, lk_ttt_loss) and the chunk-at-a-time pieces that
`objectives.chunked_objective` trains EAGLE-3 and P-EAGLE with (lk_terms, lk_lambda_of,
sum_over_ranks). draft.loss: lk_alpha | lk_lambda."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

LK_MODES = ("alpha", "lambda")
LK_KL_SCALE = 1.0  # SpecForge's defaults
LK_KL_DECAY = 1.0


def acceptance_rate(target_probs: torch.Tensor, draft_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """alpha = sum_v min(p_target, p_draft) per row (..., V) -> (...): the chance speculative
    sampling accepts the draft's token. target_probs over the draft vocab, NOT renormalised
    (SpecForge's target_p_on_draft: target mass outside the draft vocab is never accepted)."""
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    return torch.minimum(target_probs.float(), q).sum(dim=-1)


def lk_loss(
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    target_probs_on_draft: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    kl_scale: float = LK_KL_SCALE,
    kl_decay: float = LK_KL_DECAY,
    temperature: float = 1.0,
) -> torch.Tensor:
    """SpecForge's LK loss of one TTT step (`specforge/core/lk_loss.py`, sgl-project/SpecForge at
    commit a6b6b0230009d15ec2a97a57384e6f53f0f96946; its last change c6100c46), over rows (N, V):

        alpha_r = sum_v min(p_on_draft, q)       per counted row (mask (N,) bool)
        alpha   mode: mean_r -log alpha_r         (a row with alpha_r = 0 adds 0, as SpecForge)
        lambda  mode: lam = kl_scale * exp(-kl_decay * mean_r alpha_r) (detached: one per step)
                      lam * mean_r KL(p || q) + (1 - lam) * (1 - mean_r alpha_r)

    target_probs: the target renormalised over the draft vocab (the KL's teacher);
    target_probs_on_draft: its probabilities before renormalising (acceptance). KL, not
    SpecForge's soft CE: the two differ by the constant lam * H(p), same gradient. Means are over
    the counted rows; a family weights its TTT steps 0.8^i on top (EAGLE-3's ttt_decay).
    """
    if mode not in LK_MODES:
        raise ValueError(f"lk mode must be one of {LK_MODES}, got {mode!r}")
    m = mask.float()
    rows = m.sum().clamp_min(1e-8)
    alpha = acceptance_rate(target_probs_on_draft, draft_logits, temperature)
    if mode == "alpha":
        log_alpha = torch.where(alpha > 0, torch.log(alpha.clamp_min(1e-30)), torch.zeros_like(alpha))
        return -(log_alpha * m).sum() / rows
    mean_alpha = (alpha * m).sum() / rows
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    p = target_probs.float()
    kl = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)
    lam = kl_scale * torch.exp(-kl_decay * mean_alpha.detach())
    return lam * (kl * m).sum() / rows + (1.0 - lam) * (1.0 - mean_alpha)


def lk_ttt_loss(step_losses: Sequence[torch.Tensor], decay: float = 0.8) -> torch.Tensor:
    """sum_i decay^i * loss_i over TTT steps (SpecForge's ploss weights 0.8^i)."""
    return sum(decay**i * loss for i, loss in enumerate(step_losses))


# -- chunk by chunk, as training computes them ----------------------------------------------------


def lk_terms(
    q, p, log_q, log_p, teacher_logits, teacher_lse, keep, objective, with_grad: bool, lk_lambda: Optional[torch.Tensor]
) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """SpecForge's LK losses on one chunk of rows (C, V) at temperature 1 (see lk_loss below, the
    reference): the acceptance alpha_r = sum_v min(p~_v, q_v) with p~ the target's probabilities
    before renormalising over the draft vocab (exp(t - teacher_lse)); p the renormalised teacher.

    Row sums: "accept" (alpha), "kept" (rows counted), "lk_alpha" (-log alpha, 0 where alpha = 0)
    and "lk_kl" (KL(p || q), lk_lambda's other part). lk_lambda's total lam * kl + (1 - lam)(1 - alpha)
    needs the step's mean alpha, known after every chunk: _ChunkedObjective combines them.
    d alpha / dz = q (s - <s, q>) with s_v = [q_v < p~_v], the side torch.minimum differentiates.
    """
    p_accept = p if teacher_lse is None else torch.exp(teacher_logits - teacher_lse[:, None])
    alpha = torch.minimum(p_accept, q).sum(dim=-1)  # (C,)
    sums = {"accept": keep(alpha).sum(), "kept": keep(torch.ones_like(alpha)).sum()}
    grad, d_alpha = None, None
    if with_grad:
        s = (q < p_accept).to(q.dtype)
        d_alpha = s.sub_(torch.linalg.vecdot(s, q)[:, None]).mul_(q)  # (C, V)
    if "lk_alpha" in objective.names:
        positive = alpha > 0
        sums["lk_alpha"] = keep(torch.where(positive, -torch.log(alpha.clamp_min(1e-30)), 0.0)).sum()
        if with_grad:
            scale = keep(torch.where(positive, -1.0 / alpha.clamp_min(1e-30), 0.0))
            grad = d_alpha * (scale[:, None] * objective.weight("lk_alpha"))
    if "lk_lambda" in objective.names:
        sums["lk_lambda"] = alpha.new_zeros(())  # its total needs the step's lambda: the forward sets it
        sums["lk_kl"] = keep(torch.linalg.vecdot(p, log_p) - torch.linalg.vecdot(p, log_q)).sum()
        if with_grad:
            if lk_lambda is None:
                raise ValueError("lk_lambda's gradient needs the step's lambda")
            # d/dz [lam KL + (1 - lam)(1 - alpha)] = lam (q - p) - (1 - lam) d alpha / dz
            rows = (q - p).mul_(lk_lambda).sub_(d_alpha.mul_(1.0 - lk_lambda))
            grad = keep(rows.mul_(objective.weight("lk_lambda")).t()).t()  # a dropped row: no gradient
    return sums, grad


def lk_lambda_of(accept: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """lambda = kl_scale exp(-kl_decay mean alpha), the mean over the step's counted rows (no grad)."""
    return LK_KL_SCALE * torch.exp(-LK_KL_DECAY * accept / kept.clamp_min(1e-8))


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """lk_lambda's acceptance statistics summed over every rank (data and sequence parallel): lambda
    is then the mean of the whole global micro-batch, the same at any world size. (SpecForge reduces
    over its sequence-parallel group only.) Called by every rank once per step/depth, also by a
    rank with no counted rows (chunked_objective's empty case)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value
