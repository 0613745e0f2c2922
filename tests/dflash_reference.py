"""A slow DFlash written one block, one query, one head at a time: the spec the vectorised model is
checked against. It shares the draft's weights and nothing else (no masks, no gathers, no batching).
"""

import math

import torch
import torch.nn.functional as F


def rms(x, weight, eps):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, cos, sin):  # x (D,), cos/sin (D,)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[half:], x[:half]])
    return x * cos + rotated * sin


def block_hidden(draft, hidden, input_embeds, mask_embed, rotary, anchor):
    """Final hidden states (S, H) of the block anchored at `anchor` of one sequence.

    hidden {layer id: (T, Ht)}, input_embeds (T, H): the target's; mask_embed (H,): the target's
    embedding of mask_token_id; rotary(position) -> (cos (D,), sin (D,)).
    """
    d = draft.dims
    S, eps, D = d.block_size, d.rms_norm_eps, d.head_dim
    group = d.num_heads // d.num_kv_heads
    context = [
        rms(draft.fc(torch.cat([hidden[l][t] for l in d.target_layers])), draft.hidden_norm.weight, eps)
        for t in range(anchor)
    ]  # positions < anchor only
    x = [input_embeds[anchor]] + [mask_embed + draft.mask_delta for _ in range(S - 1)]
    for layer in draft.layers:
        attn = layer.self_attn
        normed = [rms(v, layer.input_layernorm.weight, eps) for v in x]

        def key_value(source, position, head):
            k = attn.k_proj(source).view(-1, D)[head]
            k = rope(rms(k, attn.k_norm.weight, eps), *rotary(position))
            return k, attn.v_proj(source).view(-1, D)[head]

        keys = {
            h: [key_value(c, t, h) for t, c in enumerate(context)]
            + [key_value(normed[u], anchor + u, h) for u in range(S)]
            for h in range(d.num_kv_heads)
        }
        new_x = []
        for s in range(S):
            heads = []
            for h in range(d.num_heads):
                q = rope(rms(attn.q_proj(normed[s]).view(-1, D)[h], attn.q_norm.weight, eps), *rotary(anchor + s))
                kv = keys[h // group]
                scores = torch.stack([q @ k / math.sqrt(D) for k, _ in kv])
                weights = torch.softmax(scores, dim=0)
                heads.append(sum(w * v for w, (_, v) in zip(weights, kv)))
            y = x[s] + attn.o_proj(torch.cat(heads))
            new_x.append(y + layer.mlp(rms(y, layer.post_attention_layernorm.weight, eps)))
        x = new_x
    return torch.stack([rms(v, draft.norm.weight, eps) for v in x])


def loss(draft, hidden, input_embeds, mask_embed, rotary, lm_head, input_ids, loss_mask, anchors, valid):
    """Weighted CE over one sequence's blocks: (sum_j w_j CE_j, counted tokens)."""
    d = draft.dims
    first = 0 if d.sample_from_anchor else 1
    total, count = torch.zeros(()), 0
    for anchor, ok in zip(anchors.tolist(), valid.tolist()):
        if not ok:
            continue
        out = block_hidden(draft, hidden, input_embeds, mask_embed, rotary, anchor)
        for j in range(d.block_size - first):
            position = anchor + 1 + j  # the token slot first + j is trained to predict
            if loss_mask[position]:
                logits = out[first + j] @ lm_head.t()
                total = total + math.exp(-j / d.loss_decay_gamma) * F.cross_entropy(
                    logits[None], input_ids[position][None]
                )
                count += 1
    return total, count
