"""EAGLE-3's training (mixed into drafts/eagle3/model.py's Eagle3Draft): training-time test's loss,
step by step, over the draft vocabulary, and the memory one micro-batch keeps.

Rules the loss keeps (docs/architecture.md): which rows each step counts is decided on the host
(no device sync); under sequence parallelism each rank holds T/N tokens, a step's teacher at t+1+k
may sit on the next rank, and each mean is over the whole sequence's counted tokens; packed
documents keep every label inside its own conversation."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from specdraft.drafts.base import CaptureRequest, DraftLoss, LossBatch, MemoryShape, rows_where
from specdraft.drafts.lk import sum_over_ranks
from specdraft.drafts.loss import teacher_vocab_pass
from specdraft.drafts.objectives import Objective, ObjectiveSums, answer_labels, chunked_objective, term_metrics


class Eagle3Training:
    """The training side of Eagle3Draft (P-EAGLE shares ttt_step_loss)."""

    def capture_request(self) -> CaptureRequest:
        # the final hidden state only when the objective reads the target's distribution
        return CaptureRequest(layers=tuple(sorted(self.dims.target_layers)), final_hidden=self.objective.needs_teacher)

    def training_loss(self, batch: LossBatch) -> DraftLoss:
        """Step k of the unroll predicts x_{t+2+k} at index t, taught by the target at t+1+k;
        the steps' losses are summed with weights ttt_decay^k."""
        features, input_ids = batch.features, batch.input_ids
        lm_head_weight, chunk_size = batch.lm_head_weight, batch.chunk_size
        B, T = input_ids.shape
        shard, host = batch.shard, batch.on_host()
        dtype = self.fc.weight.dtype
        heads = self.unroll(
            self.aux_hidden(features).to(dtype),
            features.input_embeds.to(dtype),
            self.dims.ttt_steps,
            batch.documents,
            shard,
        )
        taught = self.objective.taught(host.loss_mask, host.token_mask).bool()  # the tokens the steps predict
        draft_ids = self.draft_to_target()
        # the teacher: the target's lm_head rows of the draft vocab, never the full vocab
        teacher_rows = lm_head_weight.index_select(0, draft_ids) if self.objective.needs_teacher else None
        to_draft = self.target_to_draft(draft_ids) if self.objective.needs_labels else None
        final, in_vocab, extend, local = (
            None,
            None,
            (self.dims.ttt_steps if shard.parallel else 0),
            shard.local_length,
        )  # SP: t+1+k may be next rank's
        steps = []  # per TTT step, on the host: its counted rows, those with an answer label, the group's count
        for k in range(len(heads)):
            # index t of step k predicts x_{t+2+k}, taught by the target at t+1+k
            counted = torch.zeros(B, T, dtype=torch.bool, device=host.loss_mask.device)  # on the host, whole T
            counted[:, : max(T - 2 - k, 0)] = taught[:, 2 + k :]
            if host.documents is not None:  # packed data: x_{t+2+k} in t's own conversation
                counted[:, : max(T - 2 - k, 0)] &= host.documents[:, 2 + k :] == host.documents[:, : max(T - 2 - k, 0)]
            label_is_answer = torch.zeros_like(counted)
            label_is_answer[:, : max(T - 2 - k, 0)] = host.loss_mask[:, 2 + k :].bool()
            label_is_answer &= counted
            steps.append((shard.local(counted), shard.local(label_is_answer), shard.host_count(counted)))
        lse = None  # LK: the target's whole-vocab log-sum-exp, when the teacher rows are a draft vocab
        if self.objective.needs_teacher:
            final = shard.extend_right(features.final_hidden, extend).flatten(0, 1)  # (B (T/N + extend), Ht)
            # one pass over the target's whole vocab, at the rows some step's teacher reads: its top-1
            # (is it a draft token? on the device, no sync; always, when the draft vocab is the whole
            # one) and, for LK over a draft vocab, its log-sum-exp
            smaller = draft_ids.numel() < lm_head_weight.shape[0]
            want_lse, want_top = self.objective.lk and smaller, self.teacher_rows == "in_vocab" and smaller
            if want_top or want_lse:
                # on the host, from the steps' host masks: final's rows a teacher reads
                read = torch.zeros(B, local + extend, dtype=torch.bool)
                for k, (counted, _, _) in enumerate(steps):
                    width = max(min(local, local + extend - 1 - k), 0)  # t+1+k within final's rows
                    read[:, 1 + k : 1 + k + width] |= counted[:, :width]
                lse, top1 = teacher_vocab_pass(
                    final,
                    lm_head_weight,
                    read.flatten().nonzero().flatten(),
                    chunk_size,
                    draft_ids.numel(),
                    logsumexp=want_lse,
                    argmax=want_top,
                )
                in_vocab = None if top1 is None else self.t2d[top1]
        loss = None
        metrics: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        for k, head_in in enumerate(heads):
            counted, label_is_answer, group_tokens = steps[k]
            rows, tokens = rows_where(counted, input_ids.device)  # over this rank's (B, T/N)
            labels = shard.local(F.pad(input_ids[:, 2 + k :], (0, 2 + k))).flatten()[rows]  # x_{t+2+k}
            teacher_at = rows + rows // local * extend + 1 + k  # t+1+k in final's rows
            draft_labels, answers = None, label_is_answer.nonzero().shape[0]
            if to_draft is not None:  # CE learns the answer tokens only
                draft_labels, answers = answer_labels(to_draft[labels], label_is_answer[counted])
            out = ttt_step_loss(
                head_in.flatten(0, 1)[rows],
                self.lm_head.weight,
                None if final is None else final[teacher_at],
                teacher_rows,
                draft_labels,
                self.objective.over_rows(rows.numel(), answers),
                chunk_size,
                None if in_vocab is None else in_vocab[teacher_at],
                None if lse is None else lse[teacher_at],
                sum_over_ranks,
            )
            hits = (draft_ids[out.argmax] == labels).sum()
            step_loss, weight = shard.token_mean(out.loss, group_tokens, tokens)
            if k == 0:
                first_weight = weight
            weighted = step_loss * self.dims.ttt_decay**k
            loss = weighted if loss is None else loss + weighted
            metrics[f"ttt_{k}/loss"] = (out.loss.detach(), tokens)
            metrics[f"ttt_{k}/accuracy"] = (hits, tokens)
            for name, (value, count) in term_metrics(out.terms, tokens, answers).items():  # over every step
                total, seen = metrics.get(name, (0.0, 0))
                metrics[name] = (total + value, seen + count)
        return DraftLoss(loss=loss, tokens=first_weight, correct=metrics["ttt_0/accuracy"][0], metrics=metrics)

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        d, p, tokens, steps = self.dims, shape.dtype_bytes, shape.B * shape.T, self.dims.ttt_steps
        H, heads, kv, hd, I = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
        teacher, Vd = self.objective.needs_teacher, d.draft_vocab_size
        # per TTT step and token, saved for backward (counted with saved_tensors_hooks): the fused 2H
        # input, 3 norms' inputs and outputs, the post-attention and final norms' outputs (10 H), the
        # rotated queries and attention output (2 heads hd), the new keys/values (2 kv hd), the MLP's
        # 4I; the norms keep their inputs in fp32. Step k >= 1's TTT attention (ttt_attention.py): k
        # diagonal keys and values per query head (2k heads hd), sink-extended q/k/v, merged output (~5)
        step = (10 * H + 2 * heads * hd + 2 * kv * hd + 4 * I) * p + shape.fp32_norm_inputs(3 * H)
        attention = [heads * hd * p * (2 * k + 5) for k in range(1, steps)]
        if self.gradient_checkpointing:  # each step keeps its inputs and outputs (4 H, keys/values, a norm
            # in fp32); one step's activations come back at a time in the backward
            held = steps * ((4 * H + 2 * kv * hd) * p + 2 * H * 4) + step + max(attention, default=0)
        else:
            held = steps * step + sum(attention)
        terms = {
            # input embeddings (H), cos/sin (2 hd), the 3 captured layers and a teacher's final hidden state
            "capture features": shape.capture_features(H + 2 * hd + (3 + teacher) * d.target_hidden_size),
            "draft activations": tokens * (H * p + held),  # fc's output, then the steps
            # every step's counted rows keep their hidden-state gradient until the backward, which
            # recomputes a chunk into the head's (Vd, H) gradient in fp32
            "loss chunk + hidden grads": steps * tokens * H * p
            + Vd * H * 4
            + shape.loss_chunk(tokens, Vd, H, teacher, lk=self.objective.lk),
        }
        if teacher:  # the target lm_head's rows of the draft vocab, copied once, read by every step
            terms["teacher rows"] = Vd * d.target_hidden_size * p
        # packed documents add no term: per-conversation slices on CPU, a flex block mask on CUDA
        return terms


def ttt_step_loss(
    student_hidden,
    student_head,
    teacher_hidden,
    teacher_rows,
    labels,
    objective: Objective,
    chunk_size: int,
    teacher_keep: Optional[torch.Tensor] = None,
    teacher_lse: Optional[torch.Tensor] = None,
    reduce=None,
) -> ObjectiveSums:
    """One TTT step's objective over its counted rows: the draft's own head over the draft vocab
    against the target restricted to it (teacher_rows: the target lm_head's rows of the draft
    vocab) and/or draft-vocab labels. teacher_keep (N,) bool: the rows the teacher terms count
    (draft.teacher_rows: in_vocab); a dropped row adds nothing, and the step's mean stays over
    all its counted rows, as SpecForge's sum over position_mask is divided by every position.
    LK: teacher_lse and reduce as chunked_objective's."""
    return chunked_objective(
        student_hidden,
        student_head,
        teacher_hidden,
        teacher_rows,
        labels,
        objective,
        chunk_size,
        teacher_keep,
        teacher_lse,
        reduce,
    )
