"""EAGLE-3: one decoder layer over the fused hidden states of three target layers.

    g_t   = fc(cat(h_t at layers l1, l2, l3))                 (B, T, H)  index t: target position t
    x     = cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))       2H wide, into q/k/v
    out_t = g_t + Attn(x) ; out_t += MLP(post_attention_layernorm(out_t))   (residual: g_t, or
                                                                 hidden_norm(g_t) with norm_before_residual)
    logits = lm_head(norm(out_t))   over the draft vocab; target_id = draft_id + d2t[draft_id]

Index t predicts x_{t+2}, at RoPE position t+1 (the position of the token it embeds), as in
speculators/vLLM. Module and parameter names are speculators' saved keys (fc, layers.0.*, norm,
lm_head, d2t, t2d), so its export is a plain save.

Training-time test (TTT), step k = 0 .. ttt_steps-1 (vectorised over all positions):
    index t embeds x_{t+1+k} at position t+1+k; step 0's hidden input is g_t, step k's is the
    draft's own output of step k-1 at t; step 0 attends causally to step-0 keys <= t, step k adds
    the keys of steps 1..k at t itself (the diagonal); it predicts x_{t+2+k}, taught by the target's
    distribution at position t+1+k restricted to the draft vocab, counted where x_{t+2+k} is
    loss-masked. Loss = sum_k ttt_decay^k * mean objective of step k: `draft.loss` (default
    soft_ce against that restricted distribution; `ce` reads x_{t+2+k} as a draft-vocab label and
    skips the rows whose label is outside the draft vocab).
At inference step k is the k-th drafted token: the same keys are the verified tokens' entries
plus the entries of the tokens drafted before it, at the same positions.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.drafts.base import MemoryShape, CaptureRequest, DraftLoss, HostBatch, TargetFeatures, rows_where
from specdraft.drafts.documents import PackedDocuments
from specdraft.drafts.eagle3.decode import Eagle3Drafter
from specdraft.drafts.eagle3.export import FILE_FORMATS, write_sglang, write_speculators
from specdraft.drafts.eagle3.options import Eagle3Spec
from specdraft.drafts.eagle3.layer import (
    Eagle3Base,
    Eagle3Dims,
    TTTVisibility,
    layer_dims,
)
from specdraft.drafts.lk import sum_over_ranks
from specdraft.drafts.objectives import Objective, ObjectiveSums, answer_labels, chunked_objective, term_metrics
from specdraft.drafts.objective_options import objective_from_options, parse_objective
from specdraft.drafts.loss import teacher_vocab_pass
from specdraft.parallel.sequence import SequenceShard

log = logging.getLogger(__name__)


def ttt_visibility(T: int, step: int, device, documents: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense reference of TTTVisibility (tests), (T, (step+1) T) bool: step-0 keys causally,
    then the same-position key of steps 1..step.
    documents (B, T) of packed data -> (B, 1, T, (step+1) T): step-0 keys of the query's own
    conversation only, as at inference."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(T, dtype=torch.bool, device=device)
    if documents is not None:
        causal = causal & (documents[:, :, None] == documents[:, None, :])  # (B, T, T)
        return torch.cat([causal] + [diagonal.expand_as(causal)] * step, dim=-1)[:, None]
    return torch.cat([causal] + [diagonal] * step, dim=1)


SOFT_CE = parse_objective("soft_ce")  # EAGLE-3's own objective


class Eagle3Draft(Eagle3Spec, Eagle3Base):
    architecture = "Eagle3Draft"
    dims_type = Eagle3Dims
    serving_formats = {"speculators": write_speculators, "sglang": write_sglang}
    file_formats = FILE_FORMATS
    import_settings = ("target_layers", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    tensor_keys = (
        ("lm_head.weight", "draft.draft_vocab_size"),
        ("d2t", "draft.draft_vocab_size"),
        ("fc_norm.*", "draft.fc_norm"),
        ("input_norm.*", "draft.norm_before_fc"),
    )

    def __init__(self, dims: Eagle3Dims, objective: Objective = SOFT_CE, teacher_rows: str = "in_vocab"):
        super().__init__(dims)
        self.objective = objective  # what training_loss minimises (a training setting, not exported)
        self.teacher_rows = teacher_rows  # Eagle3Options.teacher_rows (a training setting, not exported)

    @classmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "Eagle3Draft":
        draft = cls(
            Eagle3Dims(
                **layer_dims(target_config, draft_cfg, "eagle3"),
                ttt_steps=int(draft_cfg.ttt_steps),
                ttt_decay=float(draft_cfg.ttt_decay),
                norm_output=bool(draft_cfg.norm_output),
            ),
            objective=objective_from_options(draft_cfg, default=cls.default_loss),
            teacher_rows=str(draft_cfg.teacher_rows),
        )
        draft.lm_head_source = str(draft_cfg.lm_head)
        draft.count_vocab_maps(data)
        return draft

    def describe(self) -> str:
        return "; ".join(
            [
                f"target layers {self.dims.target_layers} of {self.dims.target_num_layers}, draft vocab "
                f"{self.dims.draft_vocab_size} of {self.dims.vocab_size}, {self.dims.ttt_steps} TTT steps",
                *self.describe_refusals(),
            ]
        )

    def unroll(
        self,
        aux: torch.Tensor,
        input_embeds: torch.Tensor,
        steps: int,
        documents: Optional[torch.Tensor] = None,
        shard: Optional[SequenceShard] = None,
    ):
        """The TTT unroll over all positions at once: aux (B, T, 3 Ht) captured target states,
        input_embeds (B, T, H) embeddings of the input ids -> per step the (B, T, H) logits input
        (index t of step k predicts x_{t+2+k}). documents (B, T): packed conversations, each
        attending to itself only (RoPE is relative: a conversation's offset in the row is moot).
        shard: sequence parallelism, aux / input_embeds / the outputs are this rank's T/N tokens."""
        shard = shard or SequenceShard.whole(aux.shape[1])
        index = shard.positions(aux.device)
        hidden = self.fuse(aux)
        keys, values = [], []  # each step's (B, KV, T, D)
        heads = []
        visible = TTTVisibility(PackedDocuments.of(documents), shard if shard.parallel else None)  # once for the steps
        for k in range(steps):
            embeds = shard.shift_left(input_embeds, 1 + k)  # x_{t+1+k}
            hidden, head_in, new_k, new_v = self.step(embeds, hidden, index + 1 + k, keys, values, visible)
            keys.append(new_k)
            values.append(new_v)
            heads.append(head_in)
        return heads

    # -- training --------------------------------------------------------------------------

    def capture_request(self) -> CaptureRequest:
        # the final hidden state only when the objective reads the target's distribution
        return CaptureRequest(layers=tuple(sorted(self.dims.target_layers)), final_hidden=self.objective.needs_teacher)

    def training_loss(
        self,
        features: TargetFeatures,
        lm_head_weight,
        input_ids,
        loss_mask,
        chunk_size: int,
        documents: Optional[torch.Tensor] = None,
        host: Optional[HostBatch] = None,
        **_,
    ) -> DraftLoss:
        B, T = input_ids.shape
        shard = features.shard or SequenceShard.whole(T)
        dtype = self.fc.weight.dtype
        heads = self.unroll(
            self.aux_hidden(features).to(dtype), features.input_embeds.to(dtype), self.dims.ttt_steps, documents, shard
        )
        host = HostBatch.of(input_ids, loss_mask, documents, host)
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

    # -- decoding --------------------------------------------------------------------------

    @property
    def trained_depth(self) -> int:
        # training-time test unrolled the chain ttt_steps tokens ahead
        return int(self.dims.ttt_steps)

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

    def make_drafter(self, target: nn.Module) -> Eagle3Drafter:
        return Eagle3Drafter(self, target)


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
