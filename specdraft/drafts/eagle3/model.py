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
from typing import Optional

import torch
from torch import nn

from specdraft.target.attention import PackedDocuments
from specdraft.drafts.eagle3.decode import Eagle3Drafter
from specdraft.drafts.eagle3.export import FILE_FORMATS, write_sglang, write_speculators
from specdraft.drafts.eagle3.options import Eagle3Spec
from specdraft.drafts.eagle3.train import Eagle3Training
from specdraft.drafts.eagle3.layer import (
    Eagle3Base,
    Eagle3Dims,
    TTTVisibility,
    layer_dims,
)
from specdraft.drafts.objectives import Objective
from specdraft.drafts.objective_options import objective_from_options, parse_objective
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


class Eagle3Draft(Eagle3Spec, Eagle3Training, Eagle3Base):
    architecture = "Eagle3Draft"
    dims_type = Eagle3Dims
    serving_formats = {"speculators": write_speculators, "sglang": write_sglang}
    file_formats = FILE_FORMATS
    import_settings = ("target_layers", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

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

    # -- decoding --------------------------------------------------------------------------

    @property
    def trained_depth(self) -> int:
        # training-time test unrolled the chain ttt_steps tokens ahead
        return int(self.dims.ttt_steps)

    def make_drafter(self, target: nn.Module) -> Eagle3Drafter:
        return Eagle3Drafter(self, target)
