"""DFlash's blocks: their layout (which slot predicts which token), which keys a block query sees
(one rule, as a flex_attention BlockMask on CUDA or a dense mask for SDPA elsewhere, per
conversation on CPU with packed data), and the blocks
training samples from a batch (anchors, labels, the per-position loss weights). The model is in
model.py, its training in train.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from specdraft.drafts.base import document_starts
from specdraft.drafts.dflash.options import BlockLayout
from specdraft.target.attention import attention_path, flex_attention, make_block_mask
from specdraft.transfer import to_device


# -- which keys a block query sees ---------------------------------------------------------------


@dataclass
class BlockVisibility:
    """Training-time attention of A blocks per row over [context (T) | all blocks (A * S)].

    A query of block j (anchor a_j) sees context position t iff t < a_j, and every slot of its
    own block (bidirectional); nothing of other blocks, nothing at or after its anchor in the
    context — the anchor token itself enters only through the block's first slot. With packed
    conversations, nothing before the anchor's own conversation either (t >= context_start_j).
    """

    anchors: torch.Tensor  # (B, A) anchor position of each block
    context_len: int  # T
    block_size: int  # S
    context_start: Optional[torch.Tensor] = None  # (B, A) first context position a block sees (None: 0)
    _block_mask: Any = field(default=None, repr=False)

    @property
    def query_len(self) -> int:
        return self.anchors.shape[1] * self.block_size

    def visible(self, b, q, kv):
        """The rule, elementwise over broadcastable index tensors (also flex's mask_mod)."""
        return block_visible(self.anchors, self.context_start, self.context_len, self.block_size, b, q, kv)

    def dense(self) -> torch.Tensor:
        """(B, 1, A*S, T + A*S) bool, for scaled_dot_product_attention."""
        device = self.anchors.device
        b = torch.arange(self.anchors.shape[0], device=device)[:, None, None]
        q = torch.arange(self.query_len, device=device)[None, :, None]
        kv = torch.arange(self.context_len + self.query_len, device=device)[None, None, :]
        return self.visible(b, q, kv)[:, None]

    def block_mask(self):
        """The same rule as a flex_attention BlockMask (sparse: built once, shared by layers)."""
        if self._block_mask is None:
            # the mask_mod holds tensors and ints only (what a compiled create_block_mask guards on)
            anchors, start, T, S = self.anchors, self.context_start, self.context_len, self.block_size
            self._block_mask = make_block_mask(
                lambda b, h, q, kv: block_visible(anchors, start, T, S, b, q, kv),
                anchors.shape[0],
                self.query_len,
                T + self.query_len,
                anchors.device,
            )
        return self._block_mask


def block_visible(anchors, context_start, context_len: int, block_size: int, b, q, kv):
    """BlockVisibility's rule over index tensors b, q (block slot), kv (context, then block slots)."""
    block = q // block_size
    in_context = kv < context_len
    # clamped: flex's kernel may evaluate indices past the end of a partial tile
    block = block.clamp(max=anchors.shape[1] - 1)
    before_anchor = kv < anchors[b, block]
    if context_start is not None:
        before_anchor = before_anchor & (kv >= context_start[b, block])
    same_block = (kv - context_len) // block_size == block
    return torch.where(in_context, before_anchor, same_block)


def block_attention(q, k, v, visibility: Optional[BlockVisibility]) -> torch.Tensor:
    """q (B, Hq, Q, D), k/v (B, Hkv, K, D) -> (B, Hq, Q, D). None: every key is visible.
    CUDA: flex_attention over the BlockMask. CPU (no flex backward): SDPA under the dense mask,
    per conversation with packed data. Elsewhere (meta): the dense mask."""
    gqa = q.shape[1] != k.shape[1]
    if visibility is None:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    path = attention_path(q.device)
    if path == "flex":
        return flex_attention(q, k, v, visibility.block_mask())
    if path == "slices" and visibility.context_start is not None:
        return per_conversation_attention(q, k, v, visibility)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visibility.dense(), enable_gqa=gqa)


def per_conversation_attention(q, k, v, visibility: BlockVisibility) -> torch.Tensor:
    """CPU, packed data: each run of consecutive blocks of one conversation (sampled anchors are
    sorted: one run per conversation) over that conversation's context up to its last anchor plus
    those blocks, under the dense mask of that slice: (its blocks) x (its context + its blocks),
    not blocks x the row. Read on the host (free on CPU)."""
    T, S = visibility.context_len, visibility.block_size
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for b in range(q.shape[0]):
        starts, counts = torch.unique_consecutive(visibility.context_start[b], return_counts=True)
        parts, first = [], 0
        for start, count in zip(starts.tolist(), counts.tolist()):
            last = first + count  # blocks first .. last - 1
            end = int(visibility.anchors[b, first:last].max())  # no block here sees context >= its anchor

            def keys(x):  # (1, Hkv, (end - start) + count S, D): its context, then its blocks
                return torch.cat([x[b : b + 1, :, start:end], x[b : b + 1, :, T + first * S : T + last * S]], dim=2)

            local = BlockVisibility(visibility.anchors[b : b + 1, first:last] - start, end - start, S)
            parts.append(
                F.scaled_dot_product_attention(
                    q[b : b + 1, :, first * S : last * S], keys(k), keys(v), attn_mask=local.dense(), enable_gqa=gqa
                )
            )
            first = last
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


# -- the blocks training builds -------------------------------------------------------------------


@dataclass
class TrainingBlocks:
    """A anchors per row and what their blocks are trained to predict."""

    anchors: torch.Tensor  # (B, A) long
    valid: torch.Tensor  # (B, A) bool: False = padding (the row had fewer candidate anchors)
    labels: torch.Tensor  # (B, A, P) the token at anchor + 1 + j
    counted: torch.Tensor  # (B, A, P) bool: valid anchor and a loss-masked label

    block_size: int = 0
    context_start: Optional[torch.Tensor] = None  # (B, A) packed data: where the anchor's conversation starts

    def slot_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(B, A, S) position of each block slot, from the row's position ids (B, T): the anchor's
        position in its conversation + s, as at inference. Never the position of token anchor + s,
        which may belong to the next conversation of packed data (its positions restart)."""
        anchor_positions = position_ids.gather(1, self.anchors)
        return anchor_positions[..., None] + torch.arange(self.block_size, device=self.anchors.device)

    @property
    def label_positions(self) -> torch.Tensor:  # (B, A, P) position of each label: anchor + 1 + j
        return self.anchors[..., None] + 1 + torch.arange(self.labels.shape[-1], device=self.anchors.device)

    def previous_tokens(self, input_ids: torch.Tensor, first_slot: int) -> torch.Tensor:
        """(B, A, S): each slot's previous token, the token before the one it predicts (slot s
        predicts anchor + s + 1 - first_slot): the token at anchor + max(s - first_slot, 0), so the
        anchor for the slots up to the first predicting one."""
        offsets = (torch.arange(self.block_size, device=self.anchors.device) - first_slot).clamp_min(0)
        positions = self.anchors[..., None] + offsets  # (B, A, S)
        return input_ids.gather(1, positions.flatten(1)).view_as(positions)

    def to(self, device) -> "TrainingBlocks":
        """Drawn on the host (where the loss reads which rows count), copied to the model's device."""
        move = lambda t: to_device(t, device)  # noqa: E731  pinned, asynchronous
        return TrainingBlocks(
            move(self.anchors),
            move(self.valid),
            move(self.labels),
            move(self.counted),
            self.block_size,
            None if self.context_start is None else move(self.context_start),
        )


def sample_training_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    layout: BlockLayout,
    max_anchors: int,
    seed: int,
    documents: Optional[torch.Tensor] = None,
) -> TrainingBlocks:
    """Anchors drawn uniformly without replacement among the candidates of each row.

    A candidate anchor a has context (a >= 1), all its labels inside the row (a + span < T) and a
    counted first label (loss_mask[a + 1]): the first prediction of a block is the token right
    after the last verified one, as at inference. A is fixed by T (static shapes for the
    compiled GPU path); rows with fewer candidates are padded with invalid anchors at position 1.
    documents (B, T) of packed data: the anchor's context and every counted label lie in the
    anchor's own conversation (context_start: where it starts), as at inference.
    """
    B, T = input_ids.shape
    device = input_ids.device
    last = T - 1 - layout.span  # the last anchor whose labels all fit
    count = max(0, min(max_anchors, last))
    candidate = torch.zeros(B, T, dtype=torch.bool, device=device)
    if last >= 1:
        candidate[:, 1 : last + 1] = loss_mask[:, 2 : last + 2].bool()
        if documents is not None:  # context and the first label in the anchor's conversation
            candidate[:, 1 : last + 1] &= documents[:, 2 : last + 2] == documents[:, 1 : last + 1]
            candidate[:, 1 : last + 1] &= documents[:, 0:last] == documents[:, 1 : last + 1]
    # per-batch randomness from the loop's seed, drawn on the CPU: the same anchors on any device
    scores = torch.rand((B, T), generator=torch.Generator().manual_seed(seed)).to(device)
    scores = torch.where(candidate, scores, torch.full_like(scores, -1.0))
    top, index = scores.topk(count, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, index, torch.ones_like(index))
    anchors, order = anchors.sort(dim=1)  # ascending: neighbouring blocks share flex tiles, and a
    # conversation's blocks are consecutive (block_attention's per-conversation path on CPU)
    valid = valid.gather(1, order)
    label_pos = anchors[..., None] + 1 + torch.arange(layout.predictions, device=device)  # (B, A, P)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    counted = loss_mask.gather(1, label_pos.flatten(1)).view_as(label_pos).bool() & valid[..., None]
    context_start = None
    if documents is not None:
        counted &= (
            documents.gather(1, label_pos.flatten(1)).view_as(label_pos) == documents.gather(1, anchors)[..., None]
        )
        context_start = document_starts(documents).gather(1, anchors)
    return TrainingBlocks(anchors, valid, labels, counted, block_size=layout.block_size, context_start=context_start)


def own_blocks(blocks: TrainingBlocks, shard, static: bool = False) -> TrainingBlocks:
    """Sequence parallelism: the valid blocks whose anchor is among this rank's tokens
    (SequenceShard [start, end)), still sorted, each row padded to the same count (at least 1: every
    rank runs the layers and their collectives) with invalid blocks anchored at `start` that count
    nothing. The sampler's own padding (invalid anchors at position 1, for a static A) is dropped:
    kept, it would all land on the first rank, which would run min(max_anchors, T) blocks however
    few anchors its shard holds. static (the compiled flex path): every rank pads to the sampler's
    A, the most its shard can hold, so the block mask and attention shapes are the same for every
    batch (the count of a rank's own anchors changes with each batch: a recompile per count)."""
    if not shard.parallel or blocks.anchors.shape[1] == 0:
        return blocks
    mine = blocks.valid & (blocks.anchors >= shard.start) & (blocks.anchors < shard.end)
    A = blocks.anchors.shape[1] if static else max(1, int(mine.sum(dim=1).max()))
    order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices[:, :A]  # own blocks first, in order
    keep = mine.gather(1, order)

    def pick(x, fill):
        index = order.view(*order.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        taken = x.gather(1, index)
        return torch.where(keep.view(*keep.shape, *([1] * (x.dim() - 2))), taken, torch.full_like(taken, fill))

    anchors = pick(blocks.anchors, shard.start)
    return TrainingBlocks(
        anchors,
        pick(blocks.valid, False),
        pick(blocks.labels, 0),
        pick(blocks.counted, False),
        blocks.block_size,
        None if blocks.context_start is None else torch.where(keep, blocks.context_start.gather(1, order), anchors),
    )


def loss_weights(layout: BlockLayout, gamma: float) -> List[float]:
    """exp(-j / gamma) for the j-th predicted token (anchor + 1 + j) of a block: Python floats,
    constants of the step (no tensor to read back)."""
    return [math.exp(-j / gamma) for j in range(layout.predictions)]
