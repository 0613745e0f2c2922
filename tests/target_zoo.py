"""Tiny random targets of every architecture specdraft accepts, built from transformers' own config
classes (nothing downloaded): hidden 64, 4 heads / 2 KV heads of 16 (MLA: 4 heads, its own dims),
4 layers (three layer inputs a server captures: EAGLE-3 / DFlash defaults), the tiny demo tokenizer (vocab 512). Where the architecture has sliding-window layers
their window is 16 or 32, below the tests' max_seq_length of 64, so the window path matters.

    target_dir = build_target("gpt_oss", directory, tokenizer_dir)

Each builder is transformers' config class at the architecture's own defaults, shrunk: what is
kept of the real architecture (MoE routing, attention sinks, MLA, partial rotary, Gemma 3's
local/global layers) is written next to it. Weights are random at initializer_range 0.2 so that
greedy decoding has no near ties (lossless checks compare token ids).
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import save_target

VOCAB = 512
WINDOW = 16  # the sliding window of the windowed architectures (max_seq_length 64 in the tests)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    tie_word_embeddings=False,
)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(**COMMON, intermediate_size=128, num_hidden_layers=4, head_dim=16)


def _qwen2():  # q/k/v biases; real Qwen2 / Qwen2.5 configs have use_sliding_window false
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM, Qwen2Config(**COMMON, intermediate_size=128, num_hidden_layers=4)


def _qwen3():  # q/k norms
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(**COMMON, intermediate_size=128, num_hidden_layers=4, head_dim=16)


def _qwen3_moe():  # every layer sparse: 4 experts, top 2
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=4,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )


def _gpt_oss():  # alternating windowed / full layers, attention sinks, 4 experts top 2, YaRN RoPE
    from transformers import GptOssConfig, GptOssForCausalLM

    config = dict(COMMON, max_position_embeddings=131072)  # YaRN: 32 x its original 4096, as released
    return GptOssForCausalLM, GptOssConfig(
        **config,
        intermediate_size=64,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )


def _gemma3_text():  # local (windowed, RoPE 10k) and global (RoPE 1M) layers, the last one local as in
    # every released Gemma 3 (62 or 26 layers, one global in six); embeddings scaled by sqrt(H). Untied
    # (released Gemma 3 ties them): a random tied table makes greedy decoding repeat one token
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM, Gemma3TextConfig(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    )


def _mistral():  # Mistral v0.1: every layer windowed
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM, MistralConfig(
        **COMMON, intermediate_size=128, num_hidden_layers=4, head_dim=16, sliding_window=2 * WINDOW
    )


def _deepseek_v3():  # MLA (q/kv low-rank, decoupled interleaved RoPE: qk 16+8, v 16), a dense first layer,
    # then MoE (4 routed experts top 2 in 1 group, 1 shared), one native MTP layer (MTP_LAYER_TYPES)
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = dict(COMMON, num_key_value_heads=4)
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        **config,
        intermediate_size=128,
        num_hidden_layers=4,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


def _glm4_moe():  # partial rotary (half of each head), a dense first layer, then MoE (4 top 2, 1 shared),
    # one native MTP layer (MTP_LAYER_TYPES)
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    return Glm4MoeForCausalLM, Glm4MoeConfig(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=4,
        head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        use_qk_norm=True,
    )


def _phi3():  # fused qkv and gate/up projections; Phi-3-mini's every-layer window
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM, Phi3Config(**COMMON, intermediate_size=128, num_hidden_layers=4, sliding_window=2 * WINDOW)


BUILDERS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "gemma3_text": _gemma3_text,
    "mistral": _mistral,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
    "phi3": _phi3,
}
# qwen3_next: tests/helpers.qwen3_next_mtp_target (gated attention, partial RoPE, MoE, a native MTP layer)
MODEL_TYPES = (*BUILDERS, "qwen3_next")
# targets saved with a native MTP layer as their released checkpoints hold it: layer num_hidden_layers
# of the checkpoint (model.layers.<L>.*: enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens and
# a decoder layer), which transformers' main model drops on load and its MtpModel reads
MTP_LAYER_TYPES = ("deepseek_v3", "glm4_moe")


def build_target(model_type: str, directory, tokenizer_dir, seed: int = 0) -> Path:
    """A tiny random target of `model_type` saved in `directory` with the tokenizer of tokenizer_dir."""
    import torch

    directory = Path(directory)
    if model_type == "qwen3_next":
        from helpers import qwen3_next_mtp_target

        return qwen3_next_mtp_target(directory, tokenizer_dir, seed=seed, layers=4)
    model_class, config = BUILDERS[model_type]()
    layers = config.num_hidden_layers
    if model_type in MTP_LAYER_TYPES:  # one more decoder layer: the MTP layer's block, as transformers builds it
        config.num_hidden_layers = layers + 1
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # norms at 1 (or Gemma's 1 + 0): give them values, so a misplaced one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("sinks"):  # gpt-oss's per-head sink logits, zeros at init
                param.normal_(0.0, 1.0)
    save_target(model, directory, tokenizer_dir)
    if model_type in MTP_LAYER_TYPES:
        _add_mtp_modules(directory, layers, seed)
    saved = json.loads((directory / "config.json").read_text())
    assert saved["model_type"] == model_type, saved["model_type"]
    return directory


def _add_mtp_modules(directory: Path, layers: int, seed: int, init: float = 0.2) -> None:
    """The saved model of layers + 1 decoder layers -> a target of `layers` whose checkpoint holds
    layer `layers` as its MTP layer: the decoder layer transformers saved, plus enorm, hnorm, eh_proj,
    shared_head.norm, and DeepSeek-V3's copies of the embeddings and head beside them."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    prefix = f"model.layers.{layers}."
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    generator = torch.Generator().manual_seed(seed + 1)
    tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * init
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{name}.weight"] = 1 + torch.randn(hidden, generator=generator) * 0.1
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
