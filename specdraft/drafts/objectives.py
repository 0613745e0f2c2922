"""Training objectives of a draft against its target: hard-label CE and distillation, chunked.

    objective = parse_objective("0.9*tv + 0.1*ce", temperature=1.0)      # or {"tv": 0.9, "ce": 0.1}
    out = chunked_objective(student_hidden, student_weight, teacher_hidden, teacher_weight,
                            labels, objective, chunk_size)                # sums over rows
    out.loss / n  -> backward;  out.terms["tv"] / n  -> log

Per row, with z = student logits, t = teacher logits, q = softmax(z / T), p = softmax(t / T):
    ce       -log softmax(z)[label]              hard label, at temperature 1 (LongSpec's loss);
                                                  0 for a label < 0 (none in the student's vocab)
    soft_ce  -sum p log q                        cross-entropy against the teacher's distribution
    kl       sum p (log p - log q)               = soft_ce - H(p): same gradient, 0 when q = p
    tv       1/2 sum |p - q|                     speculative sampling at T accepts with 1 - tv
The temperature T softens teacher and student alike, because decoding at T samples both from
softmax(logits / T); no T^2 factor, so each term is exactly the quantity named.

Which tokens: CE learns the answer tokens (the loss mask), whose text is the target's output.
The teacher terms can learn every token instead (`draft.distill_tokens: all`): the frozen target
computes its distribution at prompt and template tokens too, and those rows show the draft
contexts that the answers alone never reach. A loss then counts every row, CE keeps to the
answer rows (label -1 elsewhere) and is still their mean (`Objective.over_rows`).

Teacher logits are t = teacher_hidden @ teacher_weight.T: the target's final hidden state through
its lm_head for GLIDE, through the lm_head rows of a restricted draft vocabulary for EAGLE-3 (whose
student head then spans that vocabulary too): one code path. Neither student nor teacher logits
ever exist for all rows at once: with a frozen head (GLIDE, DFlash) the forward pass computes loss
and gradient one chunk of rows at a time and keeps only the (rows x hidden) gradient; a trained
head (EAGLE-3, one call per TTT step) keeps only the inputs, and backward recomputes the chunks for
both gradients, so no (vocab x hidden) gradient waits from forward to backward. A frozen head with
a few trained columns (DSpark's [lm_head | markov_w2]: `weight_tail`) takes the frozen path and
makes the tail's small (vocab x rank) gradient in the same pass.
"""

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

import torch

from specdraft.drafts.lk import lk_lambda_of, lk_terms
from specdraft.drafts.loss import chunked_cross_entropy, default_chunk_size
from specdraft.drafts.objective_options import (
    CE,
    Objective,
)
from specdraft.transfer import to_device


def term_metrics(
    terms: Mapping[str, torch.Tensor], rows: torch.Tensor, answers: int
) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """{"objective/<name>": (sum, count)} of one loss call: CE a mean over its `answers` rows,
    every teacher term over all its `rows` (a 0-dim count on the device)."""
    metrics = {f"objective/{name}": (value, rows) for name, value in terms.items()}
    if "ce" in terms:
        metrics["objective/ce"] = (terms["ce"], torch.full((), answers, dtype=rows.dtype, device=rows.device))
    return metrics


def answer_labels(labels: torch.Tensor, is_answer: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """labels (N,) on the model's device and is_answer (N,) bool on the host -> the labels with -1
    (no CE term) where the token is not an answer token, and how many answer rows there are."""
    answers = is_answer.nonzero().shape[0]  # counted on the host: no tensor value is read
    if answers == is_answer.numel():
        return labels, answers
    return labels.masked_fill(to_device(~is_answer, labels.device), -1), answers


# -- one chunk of rows ---------------------------------------------------------------------------


def objective_terms(
    student_logits: torch.Tensor,
    teacher_logits: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    objective: Objective,
    with_grad: bool,
    teacher_keep: Optional[torch.Tensor] = None,
    teacher_lse: Optional[torch.Tensor] = None,
    lk_lambda: Optional[torch.Tensor] = None,
) -> Tuple[Dict[str, torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Row sums of each term (plus 'tv' whenever there is a teacher), d(weighted sum)/d logits, and
    each row's own tv (C,) when there is a teacher (1 - tv: DSpark's acceptance target), else None.

    student_logits / teacher_logits (C, V) float32 (consumed: teacher_logits is overwritten);
    labels (C,) long; teacher_keep (C,) bool or None: the rows the teacher terms count (the
    others add nothing to them and get no gradient from them). The gradient (C, V) float32 is None unless with_grad. Vocab-sized
    temporaries are reused in place: this runs once per chunk on the largest tensors of the step.
    LK (see lk_terms): teacher_lse (C,) the target's log-sum-exp over its whole vocabulary (None:
    the teacher's vocabulary is the whole one); lk_lambda the step's lambda, needed for a gradient.
    """
    z = student_logits
    sums: Dict[str, torch.Tensor] = {}
    grad: Optional[torch.Tensor] = None
    row_tv: Optional[torch.Tensor] = None

    def accumulate(term: torch.Tensor, weight: float) -> None:  # term is ours to overwrite
        nonlocal grad
        if grad is None:
            grad = term.mul_(weight)
        else:
            grad.add_(term, alpha=weight)

    if objective.needs_labels:
        # a label < 0 has no CE (EAGLE-3: a target token outside the draft vocab); no sync to ask
        has_label = labels >= 0
        labels = labels.clamp_min(0)
        log_z = torch.logsumexp(z, dim=-1)  # (C,)
        sums["ce"] = ((log_z - z.gather(1, labels[:, None]).squeeze(1)) * has_label).sum()
        if with_grad:
            probs = z.sub(log_z[:, None]).exp_()
            probs[torch.arange(len(labels), device=z.device), labels] -= 1.0  # softmax - onehot
            accumulate(probs.mul_(has_label[:, None]), objective.weight("ce"))
    if teacher_logits is not None:
        T = objective.temperature
        log_q = torch.log_softmax(z / T if T != 1.0 else z, dim=-1)  # (C, V)
        log_p = torch.log_softmax(teacher_logits.div_(T) if T != 1.0 else teacher_logits, dim=-1)
        q, p = log_q.exp(), log_p.exp()
        keep = (lambda rows: rows) if teacher_keep is None else (lambda rows: rows * teacher_keep)
        if objective.lk:
            lk_sums, lk_grad = lk_terms(
                q, p, log_q, log_p, teacher_logits, teacher_lse, keep, objective, with_grad, lk_lambda
            )
            sums.update(lk_sums)
            if lk_grad is not None:
                accumulate(lk_grad, 1.0)
        if "soft_ce" in objective.names or "kl" in objective.names:
            cross = keep(torch.linalg.vecdot(p, log_q)).sum()  # sum p log q
            sums["soft_ce"] = -cross
            if "kl" in objective.names:
                # sum p log p - sum p log q: exactly 0 when the two rows are the same floats
                sums["kl"] = keep(torch.linalg.vecdot(p, log_p)).sum() - cross
            if "soft_ce" not in objective.names:
                del sums["soft_ce"]
        del log_q, log_p
        diff = p.neg_().add_(q)  # q - p, in p's storage
        if teacher_keep is not None:
            diff.mul_(teacher_keep[:, None])  # a dropped row: no tv, no gradient from the teacher
        row_tv = 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)  # (C,): 0 on a dropped row
        sums["tv"] = row_tv.sum()
        if with_grad:
            # soft CE and KL differ by H(p), a constant: both have gradient (q - p) / T
            soft = objective.weight("soft_ce") + objective.weight("kl")
            tv = objective.weight("tv")
            if soft:
                accumulate(diff.clone() if tv else diff, soft / T)
            if tv:
                # d tv / dz_j = 1/(2T) q_j (s_j - sum_i s_i q_i), s = sign(q - p)
                sign = diff.sign_()
                sign.sub_(torch.linalg.vecdot(sign, q)[:, None]).mul_(q)
                accumulate(sign, tv * 0.5 / T)
    return sums, grad, row_tv


# -- all rows, chunked -------------------------------------------------------------------------


@dataclass
class ObjectiveSums:
    loss: torch.Tensor  # weighted sum over rows (differentiable): divide by the counted rows
    correct: torch.Tensor  # 0-dim long: student argmax == label (teacher argmax without labels)
    terms: Dict[str, torch.Tensor]  # name -> 0-dim float32 sum over rows of that term (detached)
    argmax: Optional[torch.Tensor]  # (N,) long: the student's top-1 per row (EAGLE-3 maps it to target ids)
    row_tv: Optional[torch.Tensor] = None  # (N,) float32 detached: each row's tv, when there is a teacher


def _objective_chunks(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels,
    teacher_keep,
    teacher_lse,
    objective: Objective,
    chunk_size: int,
    term_names: Tuple[str, ...],
    grad_hidden=None,
    grad_weight=None,
    lk_lambda=None,
):
    """One pass over the rows, a chunk at a time -> (sums of each term (len(term_names),), hits,
    argmax (N,), each row's tv (N,) or an empty tensor without a teacher); fills grad_hidden (N, H)
    / grad_weight (V, H') fp32 with d(weighted sum) when given; a narrower grad_weight (H' < H) is
    that of the weight's last H' columns (a trained tail).
    student_hidden (N, H), student_weight (V, H), teacher_hidden (N, Ht) or None,
    teacher_weight (V, Ht) or None, labels (N,) or None, teacher_keep (N,) bool or None."""
    device = student_hidden.device
    sums = torch.zeros(len(term_names), dtype=torch.float32, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    argmax = torch.empty(student_hidden.shape[0], dtype=torch.long, device=device)
    row_tv = torch.empty(0 if teacher_hidden is None else student_hidden.shape[0], dtype=torch.float32, device=device)
    with_grad = grad_hidden is not None or grad_weight is not None
    for start in range(0, student_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        h = student_hidden[rows]
        z = (h @ student_weight.t()).float()  # (C, V): with t, the only vocab-sized tensors alive
        t = (
            None
            if teacher_hidden is None
            else (teacher_hidden[rows].to(teacher_weight.dtype) @ teacher_weight.t()).float()
        )
        y = None if labels is None else labels[rows]
        keep = None if teacher_keep is None else teacher_keep[rows]
        lse = None if teacher_lse is None else teacher_lse[rows]
        terms, grad, rows_tv = objective_terms(z, t, y, objective, with_grad, keep, lse, lk_lambda)
        if rows_tv is not None:
            row_tv[rows] = rows_tv
        sums += torch.stack([terms[name] for name in term_names])
        argmax[rows] = z.argmax(dim=-1)
        correct += (argmax[rows] == (y if y is not None else t.argmax(dim=-1))).sum()
        if grad_hidden is not None:
            grad_hidden[rows] = (grad.to(student_weight.dtype) @ student_weight).to(student_hidden.dtype)
        if grad_weight is not None:  # (V, H') += (V, C) @ (C, H'): the columns it is the gradient of
            grad_weight.addmm_(grad.t(), h[:, h.shape[1] - grad_weight.shape[1] :].float())
    return sums, correct, argmax, row_tv


class _ChunkedObjective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        labels,
        teacher_keep,
        teacher_lse,
        weight_tail,
        objective: Objective,
        chunk_size: int,
        term_names: Tuple[str, ...],
        reduce,
    ):
        if chunk_size <= 0:  # the config's 0: sized from the vocab
            chunk_size = default_chunk_size(student_weight.shape[0])
        inputs = (student_hidden, student_weight, teacher_hidden, teacher_weight, labels, teacher_keep, teacher_lse)
        # lk_lambda's gradient needs the step's lambda, known after the last chunk: recompute too
        ctx.recompute = ctx.needs_input_grad[1] or "lk_lambda" in objective.names
        tail_grad = ctx.needs_input_grad[7]
        ctx.tail_dtype = None if weight_tail is None else weight_tail.dtype
        if ctx.recompute:
            # A trained head (EAGLE-3's) has a (V, H) gradient, which would be held from here to
            # backward once per call (per TTT step): keep the inputs and recompute the chunks there.
            sums, correct, argmax, row_tv = _objective_chunks(*inputs, objective, chunk_size, term_names)
            ctx.save_for_backward(*inputs, weight_tail)
            ctx.options = (objective, chunk_size, term_names)
        else:  # a frozen head: the (N, H) gradient (and a tail's (V, r)) is made here, in the same pass as the loss
            grad_hidden = torch.empty_like(student_hidden) if ctx.needs_input_grad[0] else None
            grad_tail = weight_tail.new_zeros(weight_tail.shape, dtype=torch.float32) if tail_grad else None
            sums, correct, argmax, row_tv = _objective_chunks(
                *inputs, objective, chunk_size, term_names, grad_hidden, grad_tail
            )
            ctx.save_for_backward(grad_hidden, grad_tail)
        ctx.lk_lambda = None
        if "lk_lambda" in objective.names:
            # lam from the mean acceptance of the step's rows (of every rank's: `reduce` sums over
            # them), then its rows' total lam KL + (1 - lam)(1 - alpha)
            at = {name: i for i, name in enumerate(term_names)}
            accept, kept = reduce(sums[at["accept"]].clone()), reduce(sums[at["kept"]].clone())
            ctx.lk_lambda = lk_lambda_of(accept, kept)
            sums[at["lk_lambda"]] = ctx.lk_lambda * sums[at["lk_kl"]] + (1.0 - ctx.lk_lambda) * (
                sums[at["kept"]] - sums[at["accept"]]
            )
        # Python floats: a weights tensor made here would be a host-to-device copy per call
        total = sum(sums[i] * objective.weight(name) for i, name in enumerate(term_names))
        ctx.mark_non_differentiable(correct, sums, argmax, row_tv)
        return total, correct, sums, argmax, row_tv

    @staticmethod
    def backward(ctx, grad_total, _grad_correct, _grad_sums, _grad_argmax, _grad_row_tv):
        grad_weight = grad_tail = None
        if ctx.recompute:
            *inputs, weight_tail = ctx.saved_tensors
            student_hidden, student_weight = inputs[:2]
            grad_hidden = torch.empty_like(student_hidden) if ctx.needs_input_grad[0] else None
            trained = student_weight if ctx.needs_input_grad[1] else weight_tail if ctx.needs_input_grad[7] else None
            grad = None if trained is None else trained.new_zeros(trained.shape, dtype=torch.float32)
            _objective_chunks(*inputs, *ctx.options, grad_hidden, grad, ctx.lk_lambda)
            if grad is not None:
                grad = (grad * grad_total).to(trained.dtype)
            grad_weight, grad_tail = (grad, None) if ctx.needs_input_grad[1] else (None, grad)
        else:
            grad_hidden, grad_tail = ctx.saved_tensors
            if grad_tail is not None:
                grad_tail = (grad_tail * grad_total).to(ctx.tail_dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total.to(grad_hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, grad_tail, None, None, None, None


def chunked_objective(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: Optional[torch.Tensor],
    teacher_weight: Optional[torch.Tensor],
    labels: Optional[torch.Tensor],
    objective: Objective,
    chunk_size: int = 1024,
    teacher_keep: Optional[torch.Tensor] = None,
    teacher_lse: Optional[torch.Tensor] = None,
    reduce=None,
    weight_tail: Optional[torch.Tensor] = None,
) -> ObjectiveSums:
    """Sums over rows of `objective` for student logits student_hidden @ student_weight.T.

    The rows are the counted positions only (select them before the call). The teacher
    (teacher_hidden, teacher_weight) is a constant and needed when objective.needs_teacher;
    labels when objective.needs_labels. student_weight receives a gradient only when it
    requires one (a frozen shared lm_head does not). teacher_keep (N,) bool: the rows the teacher
    terms count (None: all; the sums stay sums, the caller divides).
    LK: teacher_lse (N,) the target's log-sum-exp over its whole vocab when teacher_weight holds only
    the draft vocab's rows (None: they are the whole vocab); reduce sums lk_lambda's acceptance
    statistics over the ranks (lk.sum_over_ranks; None: this rank's own), called on every rank. Its terms add
    "accept", the rows' summed acceptance sum_v min(p, q) (a metric).
    weight_tail (V, r): the trained parameter that student_weight's last r columns hold (DSpark's
    markov_w2 beside the frozen lm_head); it alone gets the weight's gradient, made in the forward
    pass (a (V, r) tensor kept to backward) instead of a recomputed (V, H + r) one.
    """
    if weight_tail is not None:
        if weight_tail.shape[0] != student_weight.shape[0] or weight_tail.shape[1] > student_weight.shape[1]:
            raise ValueError(f"weight_tail {tuple(weight_tail.shape)}: not columns of {tuple(student_weight.shape)}")
        student_weight = student_weight.detach()  # its gradient is the tail's alone
    if objective.needs_teacher and (teacher_hidden is None or teacher_weight is None):
        raise ValueError(f"objective {objective} needs the teacher's hidden states and lm_head")
    if objective.needs_labels and labels is None:
        raise ValueError(f"objective {objective} needs labels")
    if teacher_hidden is not None and not objective.needs_teacher:
        teacher_hidden = teacher_weight = None  # nothing reads them: skip the second matmul
    if teacher_hidden is not None:
        teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    term_names = objective.names + (("tv",) if teacher_hidden is not None and "tv" not in objective.names else ())
    if objective.lk:  # the acceptance statistics, lk_lambda's KL part
        term_names += ("accept", "kept") + (("lk_kl",) if "lk_lambda" in objective.names else ())
    if student_hidden.shape[0] == 0:  # an all-masked batch: zero loss, graph still connected
        zero = student_hidden.sum() * 0.0 + sum(
            w.sum() * 0.0 for w in (student_weight, weight_tail) if w is not None and w.requires_grad
        )
        terms = {
            name: torch.zeros((), dtype=torch.float32, device=student_hidden.device)
            for name in term_names
            if name not in ("kept", "lk_kl")
        }
        if "lk_lambda" in objective.names and reduce is not None:  # the other ranks' lambda waits on ours
            reduce(terms["accept"].clone()), reduce(terms["accept"].clone())
        none = torch.zeros(0, dtype=torch.long, device=student_hidden.device)
        return ObjectiveSums(zero.float(), none.sum(), terms, none)
    total, correct, sums, argmax, row_tv = _ChunkedObjective.apply(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        labels,
        teacher_keep,
        teacher_lse,
        weight_tail,
        objective,
        chunk_size,
        term_names,
        reduce or (lambda x: x),
    )
    internal = ("kept", "lk_kl")  # lk_lambda's pieces, not terms of their own
    terms = {name: sums[i] for i, name in enumerate(term_names) if name not in internal}
    return ObjectiveSums(total, correct, terms, argmax, row_tv if teacher_hidden is not None else None)


def shared_head_objective(
    student_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    teacher_hidden: Optional[torch.Tensor],
    labels: torch.Tensor,
    objective: Objective,
    chunk_size: int,
) -> ObjectiveSums:
    """The objective of a draft that reads the target's own frozen lm_head (GLIDE, DFlash): the
    teacher is the target's final hidden state through that same head. Plain CE takes the
    in-place chunked CE, the cheapest path (it logs no terms and no argmax)."""
    if objective == CE:
        total, correct = chunked_cross_entropy(student_hidden, lm_head_weight, labels, chunk_size)
        return ObjectiveSums(total, correct, {}, argmax=None)
    return chunked_objective(
        student_hidden, lm_head_weight, teacher_hidden, lm_head_weight, labels, objective, chunk_size
    )


# -- the peers' newest losses, on per-position tensors (issue 35) ----------------------------------
# Building blocks for a family whose loss has every position's value at hand (rows × vocab logits
# or per-position CE); they are not yet wired into the chunked objective above.

DPACE_ALPHA = 0.5  # speculators' default smoothing constant
DPACE_EPS = 1e-5  # speculators' _LOSS_REDUCTION_EPS


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """D-PACE's per-position weights (speculators `losses/utils.py: dpace_loss_decay`), no grad.

    ce, mask (blocks, S): each slot's cross-entropy and whether it counts (the anchor slot of a
    DFlash block does not). q = exp(-ce) is the slot's confidence, s = (1 - alpha) q + alpha
    (1 at an uncounted slot), prefix_k = prod_{j<=k} s_j: the chance the block survives to k;
    w_k = sum_{j>=k} prefix_j m_j: how much the expected accepted length still depends on slot k.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        m = mask.float()
        smooth = torch.where(m > 0, (1.0 - alpha) * torch.exp(-ce.float()) + alpha, torch.ones_like(m))
        prefix = torch.cumprod(smooth, dim=-1)
        return (prefix * m).flip(-1).cumsum(-1).flip(-1) * m


def dpace_loss(ce: torch.Tensor, mask: torch.Tensor, alpha: float = DPACE_ALPHA) -> torch.Tensor:
    """sum(w * ce * m) / (sum(m) + 1e-5) over blocks (blocks, S) of per-slot CE: speculators'
    D-PACE reduction of one sequence (`loss_function` with `dpace_loss_decay`)."""
    m = mask.to(ce.dtype)
    return (dpace_weights(ce, mask, alpha) * ce * m).sum() / (m.sum() + DPACE_EPS)
