"""P-EAGLE's training (mixed into drafts/peagle/model.py's PEagleDraft): the COD slots drawn per
batch, one mean of the objective over every counted slot of every depth, and the memory one
micro-batch keeps.

Rules the loss keeps (docs/architecture.md): the slots are drawn on the host copy of the batch at
fixed shapes, from the batch's seed (exact resume, no device sync); under sequence parallelism each
rank trains the slots anchored in its T/N tokens and the mean is over the whole sequence's counted
slots; packed documents keep every slot inside its own conversation."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from specdraft.drafts.base import CaptureRequest, DraftLoss, LossBatch, MemoryShape
from specdraft.drafts.lk import sum_over_ranks
from specdraft.drafts.loss import teacher_vocab_pass
from specdraft.drafts.objectives import answer_labels, chunked_objective, term_metrics
from specdraft.drafts.peagle.cod import CODBatch, cod_sample_batch
from specdraft.transfer import to_device


class PEagleTraining:
    """The training side of PEagleDraft."""

    def capture_request(self) -> CaptureRequest:
        return CaptureRequest(layers=tuple(sorted(self.dims.target_layers)), final_hidden=self.objective.needs_teacher)

    def sample_batch_options(self, generator: torch.Generator, seq_len: int) -> Dict[str, int]:
        return {"cod_seed": int(torch.randint(0, 2**62, (1,), generator=generator))}

    def sample_slots(self, valid: torch.Tensor, cod_seed: int) -> CODBatch:
        """valid (B, T) bool -> every row's slots at fixed shapes (cod_sample_batch), drawn from
        one generator seeded with cod_seed: a pure function of the batch's seed (exact resume)."""
        generator = torch.Generator().manual_seed(int(cod_seed))
        d = self.dims
        return cod_sample_batch(valid, d.num_depths, d.down_sample_ratio, d.down_sample_ratio_min, generator)

    def training_loss(self, batch: LossBatch) -> DraftLoss:
        """Slot (a, d) predicts x_{a+d+2}, taught by the target at a+d+1."""
        features, input_ids = batch.features, batch.input_ids
        lm_head_weight, chunk_size = batch.lm_head_weight, batch.chunk_size
        B, T = input_ids.shape
        shard, host = batch.shard, batch.on_host()
        dtype = self.fc.weight.dtype
        device = input_ids.device
        aux = self.aux_hidden(features).to(dtype)
        embeds = features.input_embeds.to(dtype)
        # SP: a depth-0 slot reads x_{a+1}, the teacher of (a, d) is at a+d+1: the next rank's first rows
        extend = self.dims.num_depths if shard.parallel else 0
        if shard.parallel:
            embeds = shard.extend_right(embeds, 1)
        taught = self.objective.taught(host.loss_mask, host.token_mask).bool()
        # slot at o predicts x_{o+2}: valid where that token is taught, in o's own conversation
        valid = torch.zeros(B, T, dtype=torch.bool)
        valid[:, : max(T - 2, 0)] = taught[:, 2:]
        if host.documents is not None:
            valid[:, : max(T - 2, 0)] &= host.documents[:, 2:] == host.documents[:, : max(T - 2, 0)]
        answer = torch.zeros(B, T, dtype=torch.bool)
        answer[:, : max(T - 2, 0)] = host.loss_mask[:, 2:].bool()
        # drawn on the host copy over the whole batch and sequence (fixed shapes, no loop over
        # rows), alike on every rank of an SP group: the slots of SP=1; the loss picks its rows from them
        slots = self.sample_slots(valid, batch.options.get("cod_seed", 0))
        counted = counted_slots(slots, valid)  # (B, N) on the host
        group_tokens = shard.host_count(counted)
        if shard.parallel:
            slots = slots.own(shard.start, shard.end)
            counted = counted_slots(slots, valid)
        head = self.draft_slots(
            aux, embeds, slots.anchor, slots.depth, batch.documents, input_ids, shard=shard, sizes=slots.sizes
        )  # (B, N, H)
        picked = to_device(counted.flatten().nonzero().flatten(), device)  # host indices: no sync
        head_in = head.flatten(0, 1).index_select(0, picked)
        orig = slots.anchor + slots.depth
        rows = (torch.arange(B)[:, None] * T + orig)[counted]  # row-major: each row's slots in slot order
        depths = slots.depth.expand(B, -1)[counted]
        is_answer = answer.gather(1, orig.clamp(max=T - 1))[counted]
        draft_ids = self.draft_to_target()
        teacher_rows = lm_head_weight.index_select(0, draft_ids) if self.objective.needs_teacher else None
        final = (
            shard.extend_right(features.final_hidden, extend).flatten(0, 1) if self.objective.needs_teacher else None
        )
        local_rows = shard.local_length + extend  # final's rows per batch row
        lse = None  # LK: the target's whole-vocab log-sum-exp, when the teacher rows are a draft vocab
        if self.objective.lk and draft_ids.numel() < lm_head_weight.shape[0]:  # at the rows a teacher reads
            read = (rows // T * local_rows + rows % T - shard.start + 1).unique()  # on the host, as teacher_at
            lse, _ = teacher_vocab_pass(
                final, lm_head_weight, read, chunk_size, draft_ids.numel(), logsumexp=True, argmax=False
            )
        ids = input_ids.flatten()
        to_draft = self.target_to_draft(draft_ids) if self.objective.needs_labels else None
        total_tokens = torch.full((), rows.numel(), dtype=torch.long, device=device)
        loss, hits_all = None, None
        metrics: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        for d in range(self.dims.num_depths):
            pick = (depths == d).nonzero().flatten()
            at = to_device(rows[pick], device)
            labels = ids[at + 2]
            teacher_at = at // T * local_rows + at % T - shard.start + 1  # (b, o + 1) in final's rows
            draft_labels, answers = None, is_answer[pick].nonzero().shape[0]  # on the host: no value read
            if to_draft is not None:
                draft_labels, answers = answer_labels(to_draft[labels], is_answer[pick])  # host mask: no sync
            out = chunked_objective(
                head_in.index_select(0, to_device(pick, device)),
                self.lm_head.weight,
                None if final is None else final[teacher_at],
                teacher_rows,
                draft_labels,
                self.objective.over_rows(pick.numel(), answers),
                chunk_size,
                teacher_lse=None if lse is None else lse[teacher_at],
                reduce=sum_over_ranks,
            )
            hits = (draft_ids[out.argmax] == labels).sum()
            tokens = torch.full((), pick.numel(), dtype=torch.long, device=device)
            loss = out.loss if loss is None else loss + out.loss
            hits_all = hits if hits_all is None else hits_all + hits
            metrics[f"depth_{d}/loss"] = (out.loss.detach(), tokens)
            metrics[f"depth_{d}/accuracy"] = (hits, tokens)
            for name, (value, count) in term_metrics(out.terms, tokens, answers).items():
                total, seen = metrics.get(name, (0.0, 0))
                metrics[name] = (total + value, seen + count)
        # one mean over every counted slot of every depth (speculators' loss_function); SP: this
        # rank's share of the sequence's mean, weighted by the group's counted slots
        if not shard.parallel:
            return DraftLoss(
                loss=loss / total_tokens.clamp_min(1), tokens=total_tokens, correct=hits_all, metrics=metrics
            )
        loss, weight = shard.token_mean(loss, group_tokens, total_tokens)
        return DraftLoss(loss=loss, tokens=weight, correct=hits_all, metrics=metrics)

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        d, p = self.dims, shape.dtype_bytes
        H, heads, kv, hd, I = d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size
        teacher, Vd = self.objective.needs_teacher, d.draft_vocab_size
        # slots per sequence: T at depth 0 plus sum_d max(r^d, r_min) T (an upper bound: the valid
        # positions are at most T)
        per_token = 1 + sum(max(d.down_sample_ratio**k, d.down_sample_ratio_min) for k in range(1, d.num_depths))
        slots = shape.B * shape.T * per_token
        # per slot, saved for backward: EAGLE-3's step (the fused 2H input, norms, q/k/v, MLP) plus
        # fc's output gathered to each slot (fc runs once per position: its input is the capture's)
        step = (11 * H + 2 * heads * hd + 2 * kv * hd + 4 * I) * p + shape.fp32_norm_inputs(3 * H)
        terms = {
            "capture features": shape.capture_features(H + (3 + teacher) * d.target_hidden_size),
            "draft activations": slots * step,
            # cod_attention.py: per depth d >= 1, over T positions, EAGLE-3's TTT attention at step d
            # (its d diagonal keys and values per query head, sink-extended q/k/v, merged output:
            # heads hd (2d + 5)) plus the queries put at their anchors (heads hd) and the depth's
            # keys and values (2 kv hd); no (N, N) mask
            "slot attention": shape.B
            * shape.T
            * p
            * sum(heads * hd * (2 * k + 6) + 2 * kv * hd for k in range(1, d.num_depths)),
            # one loss call per depth: depth 0's B T rows are the largest chunk
            "loss chunk + hidden grads": Vd * H * 4
            + shape.loss_chunk(int(slots), Vd, H, teacher, calls=max(1, int(per_token)), lk=self.objective.lk),
        }
        if shape.whole_T > shape.T:  # sequence parallelism: T is this rank's shard
            n = shape.T * per_token  # the rank's slots per row: its T at depth 0, the deeper ones anchored in it
            keys = shape.whole_T + n - shape.T  # the gathered depth-0 keys, then its deeper slots'
            # cod_attention.GatheredCODSlots instead of the per-depth path: the keys and values (whole
            # sequence + own deeper slots) and the dense (slots, keys) mask, which SDPA keeps as a
            # float bias (p bytes; the bool mask it is made from is gone before the loss's peak)
            terms["slot attention"] = shape.B * keys * (2 * kv * hd + n) * p
            # the next rank's first rows: x_{a+1} for depth 0, the teacher at a+d+1 (extend_right copies)
            terms["shard borders"] = (
                shape.B * ((shape.T + 1) * H + teacher * (shape.T + d.num_depths) * d.target_hidden_size) * p
            )
        if teacher:
            terms["teacher rows"] = Vd * d.target_hidden_size * p
        return terms


def counted_slots(slots: CODBatch, valid: torch.Tensor) -> torch.Tensor:
    """(B, N) bool on the host: slot (a, d) predicts x_{a+d+2}, counted where it was drawn and
    position a+d is valid (valid (B, T))."""
    orig = slots.anchor + slots.depth
    return slots.drawn & valid.gather(1, orig.clamp(0, valid.shape[1] - 1)) & (orig < valid.shape[1])
