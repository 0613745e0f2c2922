"""P-EAGLE: the EAGLE-3 layer drafting K tokens in one forward (speculators' PEagleDraftModel).

The layer, its fused target states and its draft vocab are EAGLE-3's (drafts/eagle3/layer.py);
index t embeds x_{t+1} with the target states g_t at RoPE position t+1 and predicts x_{t+2}.
P-EAGLE adds two learned inputs for the positions it has not seen yet:

    slot (anchor a, depth 0):  embeds x_{a+1}, hidden fc(target states at a)   predicts x_{a+2}
    slot (anchor a, depth d):  embeds mask_embedding, hidden fc(mask_hidden)   predicts x_{a+2+d}
                               at position a+d+1
    a slot sees the depth-0 slots of anchors <= a (causal context) and its own rollout (anchor
    a, depths <= d); speculators' attention.py.

At inference one forward over [the new verified positions at depth 0, depths 1..K-1 at the last
one] proposes K tokens. Training runs all K depths in one forward over the COD-sampled slots
(cod.py; seeded from the loop's batch generator, so exact resume draws the same slots); loss =
draft.loss (default KL, speculators' kl_div) to the target's distribution at a+d+1 restricted to
the draft vocab, one mean over every counted slot of every depth (no per-depth decay).

Embeddings: speculators trains the whole embed_tokens (embed_requires_grad); here the real
tokens keep the target's (frozen) embeddings and only the mask token's row is trained
(mask_embedding); the export writes the target's embed_tokens with that row replaced, which is
what speculators and vLLM read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

from specdraft.drafts.base import target_text_config
from specdraft.drafts.peagle.cod_attention import CODSlots, GatheredCODSlots
from specdraft.drafts.eagle3.layer import Eagle3Base, Eagle3Dims, layer_dims
from specdraft.drafts.objective_options import objective_from_options, parse_objective
from specdraft.drafts.peagle.cod import cod_visibility
from specdraft.drafts.peagle.decode import PEagleDrafter
from specdraft.drafts.peagle.export import FILE_FORMATS, write_speculators
from specdraft.drafts.peagle.options import PEagleSpec
from specdraft.drafts.peagle.train import PEagleTraining
from specdraft.parallel.sequence import SequenceShard
from specdraft.transfer import to_device

log = logging.getLogger(__name__)


@dataclass
class PEagleDims(Eagle3Dims):
    mask_token_id: int = 0
    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2


KL = parse_objective("kl")  # speculators' P-EAGLE loss


def _rows(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, N) row indices -> the (B, N, C) gather index of those rows of a (B, ., C) tensor."""
    return index[..., None].expand(*index.shape, x.shape[-1])


def default_mask_token(target_config) -> int:
    """speculators asks the tokenizer (its mask token, a new <|MASK|>, then pad / eos / unk);
    the draft is built from the target's config: its pad_token_id, else eos_token_id, else the
    last id of the vocabulary (DFlash's default). A pad token that is also an eos token
    (SmolLM2's <|im_end|>: pad, eos and end of turn) is one the text holds at every turn's end,
    where it would read the mask's embedding: then its unk_token_id, else the last id."""
    text = target_text_config(target_config)

    def ids(key) -> list:
        value = getattr(text, key, None)
        if value is None:
            value = getattr(target_config, key, None)
        if value is None:
            return []
        return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]

    pad, eos = ids("pad_token_id"), ids("eos_token_id")
    if pad and pad[0] not in eos:
        return pad[0]
    if not pad and eos:
        return eos[0]
    unk = [u for u in ids("unk_token_id") if u not in eos]
    return unk[0] if pad and unk else int(text.vocab_size) - 1


class PEagleDraft(PEagleSpec, PEagleTraining, Eagle3Base):
    architecture = "PEagleDraft"
    dims_type = PEagleDims
    serving_formats = {"speculators": write_speculators}
    file_formats = FILE_FORMATS
    import_settings = ("target_layers", "norm_before_residual", "norm_before_fc", "fc_norm", "mask_token_id")

    def __init__(self, dims: PEagleDims, objective=KL):
        super().__init__(dims)
        self.objective = objective  # a training setting, not exported
        aux = len(dims.target_layers) * dims.target_hidden_size
        # speculators: mask_hidden = nn.Parameter(torch.randn(1, 1, num_aux * hidden)). From a fixed
        # seed, as init_linear_weights: the same init on every rank and beside other drafts of a run
        # (the global RNG is wherever building the drafts before this one left it)
        generator = torch.Generator().manual_seed(1)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, aux, generator=generator))
        self.mask_embedding = nn.Parameter(torch.randn(dims.hidden_size, generator=generator) * dims.initializer_range)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_target_config(cls, target_config, draft_cfg, data=None) -> "PEagleDraft":
        mask = draft_cfg.mask_token_id
        if mask is None:
            mask = default_mask_token(target_config)
            log.info(
                "peagle: mask token %s (the target config's pad token, else its eos token, else its last "
                "id; a pad token that is also eos: its unk token, else its last id)",
                mask,
            )
        draft = cls(
            PEagleDims(
                **layer_dims(target_config, draft_cfg, "peagle"),
                ttt_steps=int(draft_cfg.num_depths),  # speculators' speculative_tokens
                ttt_decay=1.0,
                norm_output=False,  # one layer pass: speculators' P-EAGLE reads lm_head(norm(out)) either way
                mask_token_id=int(mask),
                num_depths=int(draft_cfg.num_depths),
                down_sample_ratio=float(draft_cfg.down_sample_ratio),
                down_sample_ratio_min=float(draft_cfg.down_sample_ratio_min),
            ),
            objective=objective_from_options(draft_cfg, default=cls.default_loss),
        )
        draft.lm_head_source = str(draft_cfg.lm_head)
        draft.count_vocab_maps(data)
        return draft

    def describe(self) -> str:
        d = self.dims
        return "; ".join(
            [
                f"target layers {d.target_layers} of {d.target_num_layers}, draft vocab "
                f"{d.draft_vocab_size} of {d.vocab_size}, {d.num_depths} depths (COD r={d.down_sample_ratio}, "
                f"r_min={d.down_sample_ratio_min}), mask token {d.mask_token_id}",
                *self.describe_refusals(),
            ]
        )

    # -- the model ---------------------------------------------------------------------------

    def slot_inputs(
        self,
        aux: torch.Tensor,
        input_embeds: torch.Tensor,
        anchor: torch.Tensor,
        depth: torch.Tensor,
        ids: Optional[torch.Tensor] = None,
        start: int = 0,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """B sequences' slots -> (embeds, hidden), (B, N, H) each. aux (B, T, 3 Ht) captured states,
        input_embeds (B, T, H) the target's embeddings of ids x_0..x_{T-1}; anchor (B, N), depth
        (N,) or (B, N). Depth 0 reads x_{a+1} (zeros past the end) and fc(aux[a]), deeper slots the
        mask token's embedding and fc(mask_hidden) (fc once per position and once for mask_hidden,
        not once per slot). Sequence parallelism: aux holds the shard's rows from position `start`,
        input_embeds those and the next one (SequenceShard.extend_right); ids stays the whole
        sequence's. An anchor past the end (CODBatch's padding) reads clamped rows."""
        first = (depth == 0).expand(anchor.shape)
        local = anchor - start
        width = input_embeds.shape[1]
        real_embeds = input_embeds.gather(1, _rows((local + 1).clamp(0, width - 1), input_embeds))
        real_embeds = torch.where((local + 1 < width)[..., None], real_embeds, torch.zeros_like(real_embeds))
        # the mask token's row is one embedding row: where the text itself holds that token, it reads it too
        is_mask = (
            ~first
            if ids is None
            else ~first | (ids.gather(1, (anchor + 1).clamp(max=ids.shape[1] - 1)) == self.dims.mask_token_id)
        )
        embeds = torch.where(is_mask[..., None], self.mask_embedding.to(real_embeds.dtype), real_embeds)
        fused = self.fuse(aux)
        states = fused.gather(1, _rows(local.clamp(0, aux.shape[1] - 1), fused))
        mask_state = self.fuse(self.mask_hidden.to(aux.dtype)[0]).to(states.dtype)  # (1, H)
        return embeds, torch.where(first[..., None], states, mask_state)

    def draft_slots(
        self,
        aux,
        input_embeds,
        anchor,
        depth,
        documents=None,
        ids=None,
        by_depth: Optional[List[torch.Tensor]] = None,
        shard: Optional[SequenceShard] = None,
        sizes: Optional[Tuple[int, ...]] = None,
    ) -> torch.Tensor:
        """One forward over B sequences' slots -> (B, N, H) the logits input (lm_head reads it);
        aux / input_embeds / anchor / depth as slot_inputs, documents and ids (B, T). sizes: the
        slots are CODBatch's (cod_sample_batch, `sizes` its places per depth), which attend
        without an (N, N) mask (cod_attention.py); None (hand-made slots in any order): through
        cod_visibility's mask. shard (sequence parallelism): the slots are this rank's
        (CODBatch.own: its positions at depth 0 first) and attend to the gathered depth-0 keys
        through a dense mask (cod_attention.GatheredCODSlots).
        One sequence (anchor (N,), aux (T, 3 Ht), input_embeds / ids / documents (T,.)) -> (N, H);
        by_depth: its slots as cod_anchors drew them (anchor, depth = slot_order(by_depth)), mask-free."""
        if anchor.dim() == 1:
            slots = None if by_depth is None else CODSlots.of(by_depth, aux.device, documents)
            head = self._draft_slots(
                aux[None],
                input_embeds[None],
                anchor[None],
                depth,
                None if documents is None else documents[None],
                None if ids is None else ids[None],
                slots,
                shard,
            )
            return head[0]
        anchor = to_device(anchor, aux.device)
        slots = (
            None
            if sizes is None or (shard is not None and shard.parallel)
            else CODSlots.of_batch(anchor, sizes, documents)
        )
        return self._draft_slots(aux, input_embeds, anchor, depth, documents, ids, slots, shard)

    def _draft_slots(
        self,
        aux,
        input_embeds,
        anchor,
        depth,
        documents,
        ids,
        slots: Optional[CODSlots],
        shard: Optional[SequenceShard],
    ) -> torch.Tensor:
        device = aux.device
        anchor, depth = to_device(anchor, device), to_device(depth, device)
        start = 0
        if shard is not None and shard.parallel:
            start, local = shard.start, shard.local_length
            key_anchor = torch.cat(
                [torch.arange(shard.length, device=device).expand(anchor.shape[0], -1), anchor[:, local:]], dim=1
            )
            key_depth = torch.cat([torch.zeros(shard.length, dtype=depth.dtype, device=device), depth[local:]])
            visible = GatheredCODSlots(
                shard, cod_visibility(anchor, depth, documents, key_anchor=key_anchor, key_depth=key_depth)[:, None]
            )
        elif slots is None:
            visible = cod_visibility(anchor, depth, documents)[:, None]
        else:
            visible = slots
        embeds, hidden = self.slot_inputs(aux, input_embeds, anchor, depth, ids, start)
        positions = anchor + depth + 1  # (B, N)
        _, head_in, _, _ = self.step(embeds, hidden, positions, None, None, visible)
        return head_in

    # -- decoding --------------------------------------------------------------------------

    @property
    def trained_depth(self) -> int:
        return int(self.dims.num_depths)

    def make_drafter(self, target: nn.Module) -> PEagleDrafter:
        return PEagleDrafter(self, target)
