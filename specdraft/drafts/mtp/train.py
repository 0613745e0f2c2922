"""MTP's training (mixed into drafts/mtp/model.py's MTPDraft): the K teacher-forced steps' weighted
cross-entropy and the memory one micro-batch keeps.

Rules the loss keeps (docs/architecture.md): which rows count is decided on the host (no device
sync); packed documents keep every label inside its own conversation. MTP trains without sequence
parallelism (MTPSpec refuses it)."""

from __future__ import annotations

from typing import Dict, List

from specdraft.drafts.base import CaptureRequest, DraftLoss, LossBatch, MemoryShape, rows_where
from specdraft.drafts.loss import chunked_cross_entropy
from specdraft.target.moe import moe_shape


class MTPTraining:
    """The training side of MTPDraft."""

    def capture_request(self) -> CaptureRequest:
        return CaptureRequest(final_hidden=True)

    def training_loss(self, batch: LossBatch) -> DraftLoss:
        """Step k's row t predicts x_{t+k+2}; loss = sum_k w_k * mean_k CE."""
        features, input_ids, host = batch.features, batch.input_ids, batch.on_host()
        dtype = self.mtp_layers[0].input_proj.weight.dtype
        outputs = self.unroll(
            features.final_hidden.to(dtype),
            features.input_embeds.to(dtype),
            features.cos,
            features.sin,
            batch.documents,
        )
        weights = step_weights(self.dims.step_weight_beta, self.dims.num_speculative_steps)
        loss, metrics = None, {}
        for k, out in enumerate(outputs):
            V = out.shape[1]
            counted = host.loss_mask[:, k + 2 : k + 2 + V].bool()  # x_{t+k+2} is learned
            if host.documents is not None:  # ... and in t's own conversation
                counted = counted & (host.documents[:, k + 2 : k + 2 + V] == host.documents[:, :V])
            rows, tokens = rows_where(counted, input_ids.device)
            labels = input_ids[:, k + 2 : k + 2 + V].flatten()[rows]
            total, hits = chunked_cross_entropy(out.flatten(0, 1)[rows], batch.lm_head_weight, labels, batch.chunk_size)
            weighted = weights[k] * total / tokens.clamp_min(1)
            loss = weighted if loss is None else loss + weighted
            metrics[f"mtp_step_{k}/loss"] = (total.detach(), tokens)
            metrics[f"mtp_step_{k}/accuracy"] = (hits, tokens)
        first_hits, first_tokens = metrics["mtp_step_0/accuracy"]
        return DraftLoss(loss=loss, tokens=first_tokens, correct=first_hits, metrics=metrics)

    def memory_terms(self, shape: MemoryShape) -> Dict[str, float]:
        c = self.config
        p, steps, H = shape.dtype_bytes, self.dims.num_speculative_steps, c.hidden_size
        tokens = shape.B * shape.T
        heads, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        moe = moe_shape(c)  # the layer's MLP is the sparse one (MTP layers are MoE: first_k_dense_replace 0)
        if moe is not None:  # per routed expert its gathered input, gate/up, product and output; router
            # logits and weights; the shared expert's gate, up, act, product, output
            inner = moe.top_k * (3 * H + 4 * moe.expert_intermediate) + 3 * moe.experts + 5 * moe.shared_intermediate
        else:
            inner = 5 * c.intermediate_size
        # per step and token, saved for backward (counted with tests/test_memory.py's LiveTensorBytes:
        # 9.8 K floats per token on its qwen3_next): the norms' inputs and outputs, the 2H
        # concatenation, input_proj's output and the residuals (13 H); q with its gate, the q/k norms,
        # the rotated q/k, the attention output and its gating (7 heads hd, 6 kv hd); the MLP's; six
        # RMSNorms keep their inputs in fp32
        attention = 7 * heads * hd + 6 * kv * hd
        if getattr(c, "kv_lora_rank", None):  # MLA (DeepSeek-V3): per head queries and keys of qk dims,
            # values of v dims, and the latents (q: q_lora_rank, kv: kv_lora_rank + rope) with their norms
            qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
            attention = heads * (5 * qk + 3 * v) + 3 * ((c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim)
        step = (13 * H + attention + inner) * p + shape.fp32_norm_inputs(6 * H)
        held = steps * step if not self.gradient_checkpointing else steps * 2 * H * p + step
        return {
            # the input embeddings, cos/sin and the target's final hidden state
            "capture features": shape.capture_features(2 * H + 2 * hd),
            "draft activations": tokens * held,
            # every step's counted rows keep their output's gradient until the backward; one chunk of
            # logits at a time against the target's (frozen) lm_head
            "loss chunk + hidden grads": steps * tokens * H * p + shape.loss_chunk(tokens, c.vocab_size, H),
        }


def step_weights(beta: float, steps: int) -> List[float]:
    """speculators' compute_step_weights: beta^k / sum_j beta^j, k = 0..steps-1."""
    raw = [beta**k for k in range(steps)]
    return [w / sum(raw) for w in raw]
