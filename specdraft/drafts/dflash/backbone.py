"""DFlash's block backbone, a shared block: DFlash (drafts/dflash/) is this backbone as it is, DSpark
(drafts/dspark/) adds its heads. A block drafter: one forward pass drafts a whole block of tokens.

    ctx    = hidden_norm(fc(cat(target hidden states of draft.target_layers)))     (B, T, H)
    block  = [anchor token, MASK x (S - 1)] at positions a .. a + S - 1            S = block_size
    x      = embeddings of the block: the anchor's is the target's; MASK's is the target's row of
             mask_token_id (+ the draft's own row `mask_delta`, trained iff train_mask_embedding)
    num_layers target-shaped layers (Qwen3-style: per-head q/k norms), each:
        keys/values = cat(k/v_proj(ctx at positions < a), k/v_proj(norm(x)))   every layer reads ctx
        x = x + Attn(norm(x))                     bidirectional inside the block
        x = x + MLP(norm(x))
    hidden = norm(x)                              the backbone's output: block hidden states
    logits = head(hidden)                         DFlash has no head: the target's lm_head

The block layout is speculators' `sample_from_anchor`:
    False  the anchor is the bonus token; slot s >= 1 predicts the token at a + s (S - 1 tokens)
    True   every slot predicts: slot s predicts the token at a + s + 1            (S tokens)
Training samples up to max_anchors anchors per sequence and runs all their blocks in one pass;
the j-th predicted token of a block (the token at a + 1 + j) weighs exp(-j / gamma) in the CE.
At inference the anchor is the last verified token x_n and the context every position < n.

The seam for the families built on DFlash (DSpark, Domino, ...): `forward()`, the backbone, gives
block hidden states; `block_head()` turns them into a `BlockHead` (logits = features @ weight.T, and
a confidence per slot where the family has one). Training, decoding and the export tests all read
logits through it, so a subclass adds its head there and nowhere else. The layout is the
`BlockLayout` flag. Attention reads a `BlockVisibility`: a flex_attention BlockMask on CUDA, a
dense boolean mask for SDPA elsewhere (flex_attention has no backward on CPU), per conversation
on CPU with packed data; all are made from the one rule in `block_visible`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from specdraft.drafts.base import (
    MemoryShape,
    CaptureRequest,
    Draft,
    DraftLoss,
    HostBatch,
    TargetFeatures,
    rows_where,
    target_layer_shape,
    target_text_config,
    uncapturable_layer,
)
from specdraft.drafts.dflash.blocks import (
    BlockVisibility,
    TrainingBlocks,
    loss_weights,
    own_blocks,
    sample_training_blocks,
)
from specdraft.drafts.dflash.decode import DFlashDrafter
from specdraft.drafts.dflash.options import (
    DFlashBackboneSpec,
    DFlashDims,
)
from specdraft.drafts.dflash.speculators import FILE_FORMAT as SPECULATORS_FILES, write_speculators_export
from specdraft.drafts.documents import attention_path
from specdraft.drafts.layers import RMSNorm
from specdraft.drafts.dflash.layer import BlockHead, DFlashLayer
from specdraft.drafts.dflash.dpace import dpace_slot_loss, row_cross_entropy
from specdraft.drafts.objectives import (
    CE,
    ObjectiveSums,
    Objective,
    answer_labels,
    chunked_objective,
    dpace_weights,
    shared_head_objective,
    term_metrics,
)
from specdraft.drafts.objective_options import objective_from_options
from specdraft.parallel.sequence import SequenceShard


# -- layers ----------------------------------------------------------------------------------------


# -- the draft -------------------------------------------------------------------------------------


class DFlashBackbone(DFlashBackboneSpec, Draft):
    """DFlash's backbone with no head of its own (the target's lm_head): the DFlash family as it is
    (drafts/dflash/), and the base of the families that add a head (drafts/dspark/)."""

    dims_type = DFlashDims
    serving_formats = {"speculators": write_speculators_export}
    file_formats = {"speculators": SPECULATORS_FILES}
    import_settings = ("target_layers", "sample_from_anchor", "mask_token_id")
    tensor_keys = (("fc.weight", "draft.target_layers"),)

    def __init__(self, dims: DFlashDims, objective: Objective = CE):
        super().__init__()
        self.dims = dims
        self.layout = dims.layout
        self.objective = objective  # what training_loss minimises (a training setting, not exported)
        # speculators' names: the native state dict is the speculators export minus mask_delta
        self.fc = nn.Linear(len(dims.target_layers) * dims.target_hidden_size, dims.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        # The draft's own MASK row, added to the target's embedding of mask_token_id. Zero and
        # frozen by default: then MASK is embedded exactly as speculators / vLLM embed it.
        self.mask_delta = nn.Parameter(torch.zeros(dims.hidden_size), requires_grad=dims.train_mask_embedding)
        if dims.train_mask_embedding:  # speculators cannot carry a trained MASK row: native export only
            self.serving_formats = {}
        self.init_linear_weights(self.dims.initializer_range)

    def describe(self) -> str:
        return "; ".join(
            [
                f"target layers {self.dims.target_layers} of {self.dims.target_num_layers}, "
                f"{self.dims.num_layers} draft layers, blocks of {self.dims.block_size}",
                *self.describe_refusals(),
            ]
        )

    def serving_refusal(self, fmt: str) -> Optional[str]:
        return uncapturable_layer(self.dims.target_layers, self.dims.target_num_layers)

    # -- building ---------------------------------------------------------------------------------

    @classmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "DFlashBackbone":
        return cls(
            cls.dims_type(**cls.dims_fields(target_config, draft_cfg)),
            objective=objective_from_options(draft_cfg, default=cls.default_loss),
        )

    @classmethod
    def dims_fields(cls, target_config, draft_cfg) -> Dict[str, Any]:
        """The dims' fields from the target's config and the `draft.` keys (a subclass adds its own)."""
        text = target_text_config(target_config)
        mask_id = draft_cfg.mask_token_id
        return dict(
            **target_layer_shape(target_config),
            hidden_act=getattr(text, "hidden_act", "silu"),
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            target_layers=cls.resolved_target_layers(draft_cfg, target_config),
            num_layers=int(draft_cfg.num_layers),
            block_size=int(draft_cfg.block_size),
            sample_from_anchor=cls.sample_from_anchor(draft_cfg),
            # default: the last row of the embedding table (an unused / reserved id in Qwen and
            # Llama-3 vocabularies); any id embeds exactly as speculators does
            mask_token_id=int(text.vocab_size - 1 if mask_id is None else mask_id),
            train_mask_embedding=bool(draft_cfg.train_mask_embedding),
            loss_decay_gamma=float(draft_cfg.loss_decay_gamma),
            loss_weighting=str(draft_cfg.get("loss_weighting", "decay")),
            dpace_alpha=float(draft_cfg.get("dpace_alpha", 0.5)),
            max_anchors=int(draft_cfg.max_anchors),
            target_num_layers=int(text.num_hidden_layers),
        )

    def capture_request(self) -> CaptureRequest:
        return CaptureRequest(
            layers=tuple(sorted(self.dims.target_layers)),
            token_embeddings=(self.dims.mask_token_id,),
            final_hidden=self.objective.needs_teacher,
        )

    # -- the backbone: block embeddings + context -> block hidden states ---------------------------

    def context(self, hidden: Dict[int, torch.Tensor]) -> torch.Tensor:
        """Target hidden states {layer id: (B, T, Ht)} -> the context every layer reads (B, T, H)."""
        stacked = torch.cat([hidden[layer] for layer in self.dims.target_layers], dim=-1)
        return self.hidden_norm(self.fc(stacked.to(self.fc.weight.dtype)))

    def context_keys_values(self, context, cos, sin) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context's (K, V) (B, KV, T, D): computed once, read by every block."""
        cos, sin = cos.to(context.dtype), sin.to(context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def block_embeddings(self, anchor_embeds: torch.Tensor, mask_embed: torch.Tensor) -> torch.Tensor:
        """anchor_embeds (B, A, H), the target's embedding of mask_token_id (H,) -> (B, A*S, H)."""
        B, A, H = anchor_embeds.shape
        mask = (mask_embed.to(self.mask_delta.dtype) + self.mask_delta).expand(B, A, self.layout.block_size - 1, H)
        return torch.cat([anchor_embeds.to(self.mask_delta.dtype)[:, :, None], mask], dim=2).view(B, -1, H)

    def forward(self, anchor_embeds, mask_embed, cos, sin, context_kv, visibility: Optional[BlockVisibility]):
        """The backbone: blocks [anchor, MASK...] (anchor_embeds (B, A, H); mask_embed (H,), the
        target's row of mask_token_id) at rotary tables cos/sin (B, A*S, D), the context's per-layer
        (K, V) -> block hidden states (B, A*S, H). One call = one draft forward pass; mask_delta is
        read here, inside the module call, so that ZeRO-3 has gathered it."""
        x = self.block_embeddings(anchor_embeds, mask_embed)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context_kv):
            x = self.run_layer(layer, x, cos, sin, context_k, context_v, visibility)
        return self.norm(x)

    # -- the head seam: block hidden states -> logits (and confidences) ---------------------------

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The (V, F) weight of the head's logits, made once per step (or once per drafter):
        DFlash's is the target's lm_head."""
        return lm_head_weight

    def block_head(
        self,
        hidden: torch.Tensor,
        previous_tokens: Optional[torch.Tensor],
        head_weight: torch.Tensor,
        state: Optional[torch.Tensor] = None,
    ) -> BlockHead:
        """hidden (..., S', H) of S' consecutive slots; previous_tokens (..., S'): each slot's
        previous token (the token before the one it predicts; the anchor for slots <= first_slot),
        read by heads that condition on it; state: a sequential head's, from the slot before.
        DFlash has no head: its logits are the target's lm_head applied to the hidden states."""
        return BlockHead(hidden, head_weight)

    def head_logits(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, previous_tokens: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Block hidden states (..., S, H) -> logits (..., S, V), through block_head."""
        return self.block_head(hidden, previous_tokens, self.head_weight(lm_head_weight)).logits()

    # -- training ---------------------------------------------------------------------------------

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

    def training_loss(
        self,
        features: TargetFeatures,
        lm_head_weight,
        input_ids,
        loss_mask,
        chunk_size: int,
        anchor_seed: int = 0,
        documents: Optional[torch.Tensor] = None,
        host: Optional[HostBatch] = None,
        **_,
    ) -> DraftLoss:
        host = HostBatch.of(input_ids, loss_mask, documents, host)
        # on the host; anchors among every token when the teacher terms learn them all
        host_blocks = self.training_blocks(
            host.input_ids, self.objective.taught(host.loss_mask, host.token_mask), anchor_seed, host.documents
        )
        shard = features.shard or SequenceShard.whole(input_ids.shape[1])
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
            lm_head_weight,
            chunk_size,
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

    # -- decoding ---------------------------------------------------------------------------------

    @property
    def trained_depth(self) -> int:
        # one block drafts block_size - 1 tokens (block_size with sample_from_anchor)
        return int(self.layout.predictions)

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

    def make_drafter(self, target) -> DFlashDrafter:
        return DFlashDrafter(self, target)
