"""bench/memory_model.py's predictions for real targets on 8 x 80 GB GPUs (nothing is measured):
Qwen3-8B and Qwen3-32B for GLIDE, Qwen3-8B per family (and per sequence_parallel_size), and the
gpt-oss-20b and Qwen3-30B-A3B mixture-of-experts targets, each with the longest context that fits."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transformers import Qwen3Config  # noqa: E402

from memory_specs import run_config  # noqa: E402
from specdraft.train.memory import estimate_peak  # noqa: E402

# The real configs (Hugging Face Qwen/Qwen3-8B and Qwen/Qwen3-32B config.json), written here
# because nothing can be downloaded on this machine.
QWEN3 = {
    "Qwen3-8B": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
    ),
    "Qwen3-32B": dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
    ),
}
# Mixture-of-experts targets, shaped as the published config.json of openai/gpt-oss-20b and
# Qwen/Qwen3-30B-A3B on Hugging Face (written here: nothing can be downloaded on this machine).
# gpt-oss-20b's release stores its experts in MXFP4; training holds them in bf16, as the model
# counts them (every parameter at the run's precision).
MOE_TARGETS = {
    "gpt-oss-20b": (
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 12,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
                "rope_theta": 150000.0,
            },
            attention_bias=True,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "Qwen3-30B-A3B": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}
GPU_BYTES = 80e9
USABLE = 0.9  # CUDA context, NCCL buffers and allocator fragmentation take the rest


def longest_that_fits(total, up_to: int = 262144) -> Optional[int]:
    """The longest context, a power of two from 4k to `up_to`, whose predicted total(seq) bytes
    fit (<= USABLE of a GPU); None when 4k does not."""
    longest, seq = None, 4096
    while seq <= up_to and total(seq) <= USABLE * GPU_BYTES:
        longest, seq = seq, seq * 2
    return longest


def longest_text(longest: Optional[int]) -> str:
    return f"{longest // 1024}k" if longest else "under 4k"


def family_rows(families: dict) -> list:
    """(family, label, gradient_checkpointing) per family, then each family that has the
    gradient_checkpointing key again with it on."""
    from specdraft.drafts import family_keys

    rows = [(family, cls.label, False) for family, cls in families.items()]
    rows += [
        (family, f"{cls.label}, gradient_checkpointing", True)
        for family, cls in families.items()
        if "gradient_checkpointing" in family_keys(cls)
    ]
    return rows


def glide_table() -> None:
    """GLIDE on Qwen3-8B and Qwen3-32B at 4k (batch 2, the shipped config) and 16k (batch 1), ZeRO-2
    and ZeRO-3 with the target replicated or partitioned: the total and its largest parts."""
    print(
        f"\nPredicted per-GPU peak, GLIDE, bf16, 8 GPUs of 80 GB (fits: <= {USABLE:.0%} of 80 GB, "
        f"no CPU offload); 4k at batch 2 (the shipped config), 16k at batch 1; packed documents "
        f"(document_mask: true):"
    )
    print(f"{'target':<10} {'seq':>4} {'ZeRO':>4} {'target placement':>16} {'GB':>6}  fits  largest parts (GB)")
    for name, values in QWEN3.items():
        config = Qwen3Config(**values)
        for seq, batch in ((4096, 2), (16384, 1)):
            for stage, placement in ((2, "replicated"), (3, "replicated"), (3, "partitioned")):
                cfg = run_config(dict(zero=stage, batch=batch, seq=seq, window=512), precision="bf16")
                est = estimate_peak(config, cfg, world_size=8, target_placement=placement)
                top = sorted(est.parts.items(), key=lambda kv: -kv[1])[:3]
                parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in top)
                fits = "yes" if est.total <= USABLE * GPU_BYTES else "no"
                print(
                    f"{name:<10} {seq // 1024:>3}k {stage:>4} {placement:>16} {est.total / 1e9:6.1f}  {fits:<4}  {parts}"
                )


def qwen3_8b_table(seqs=(4096, 32768, 65536)) -> None:
    """Per family, the predicted per-GPU peak for Qwen3-8B, ZeRO-2, 8 x 80 GB, bf16, batch 1, packed
    documents, and the longest context (a power of two from 4k) that fits."""
    from specdraft.drafts.registry import FAMILIES

    config = Qwen3Config(**QWEN3["Qwen3-8B"])
    print(
        f"\nQwen3-8B, ZeRO-2, 8 x 80 GB, bf16, batch 1, packed documents: predicted GB per GPU "
        f"(fits: <= {USABLE:.0%} of 80 GB)"
    )
    print(f"| family | {' | '.join(f'{t // 1024}k' for t in seqs)} | longest that fits |")
    print(f"|---|{'---|' * len(seqs)}---|")
    families = {family: cls for family, cls in FAMILIES.items() if cls.drafts_for("qwen3")}
    for family, label, checkpointing in family_rows(families):

        def peak(seq):
            cfg = run_config(dict(zero=2, batch=1, seq=seq, window=512, family=family), precision="bf16")
            if checkpointing:
                cfg.draft.gradient_checkpointing = True
            return estimate_peak(config, cfg, world_size=8).total

        longest = longest_that_fits(peak)
        cells = " | ".join(f"{peak(t) / 1e9:.1f}" for t in seqs)
        print(f"| {label} | {cells} | {longest_text(longest)} |")


def moe_target_config(name: str):
    from transformers import AutoConfig

    model_type, fields = MOE_TARGETS[name]
    return AutoConfig.for_model(model_type, **fields)


def moe_target_rows(seqs=(4096, 32768, 65536)) -> None:
    """gpt-oss-20b and Qwen3-30B-A3B shaped targets, per family that drafts for them: the predicted
    per-GPU peak on 8 x 80 GB, bf16, batch 1, packed documents, at ZeRO-2 (the target replicated:
    every expert's weights on every GPU) and ZeRO-3 with the target partitioned, and the longest
    context (a power of two from 4k) that fits."""
    from specdraft.drafts.registry import FAMILIES
    from specdraft.train.memory import attention_tile_bytes, mlp_working_bytes
    from specdraft.target.moe import moe_shape

    print(
        f"\nMixture-of-experts targets, 8 x 80 GB, bf16, batch 1, packed documents: predicted GB per GPU "
        f"(fits: <= {USABLE:.0%} of 80 GB)"
    )
    for name in MOE_TARGETS:
        config = moe_target_config(name)
        moe = moe_shape(config)
        print(
            f"{name}: {moe.experts} experts, top {moe.top_k}, expert intermediate {moe.expert_intermediate}, "
            f"window {getattr(config, 'sliding_window', None) or '-'}; the capture's MLP holds "
            f"{mlp_working_bytes(config, 2) / 1024:.1f} KB per token (routed activations); one row of 32k "
            f"without packed documents adds an attention tile of "
            f"{attention_tile_bytes(config, 1, 32768, 2, documents=False) / 1e9:.2f} GB"
        )
    print(f"| target, family, ZeRO (target) | {' | '.join(f'{t // 1024}k' for t in seqs)} | longest that fits |")
    print(f"|---|{'---|' * len(seqs)}---|")
    for name in MOE_TARGETS:
        config = moe_target_config(name)
        for family, cls in FAMILIES.items():
            if not cls.drafts_for(config.model_type):
                continue
            for stage, placement in ((2, "replicated"), (3, "partitioned")):

                def peak(seq):
                    cfg = run_config(dict(zero=stage, batch=1, seq=seq, window=512, family=family), precision="bf16")
                    cfg.document_mask = True
                    return estimate_peak(config, cfg, world_size=8, target_placement=placement).total

                try:
                    peak(4096)
                except Exception as err:  # a refused cell (docs/targets.md): say so, one line
                    print(f"| {name}, {cls.label} | refused: {str(err).splitlines()[0][:80]} |")
                    break
                longest = longest_that_fits(peak)
                cells = " | ".join(f"{peak(t) / 1e9:.1f}" for t in seqs)
                print(
                    f"| {name}, {cls.label}, {stage} ({placement}) | {cells} | {longest_text(longest)} |",
                    flush=True,
                )


def qwen3_8b_sequence_parallel_table(sizes=(1, 2, 4, 8)) -> None:
    """Per family, the longest context (a power of two from 4k to 1M) predicted to fit on 8 x 80 GB
    at each sequence_parallel_size: Qwen3-8B, ZeRO-2, bf16, batch 1, packed documents."""
    from specdraft.drafts.registry import FAMILIES

    config = Qwen3Config(**QWEN3["Qwen3-8B"])
    print(
        f"\nQwen3-8B, ZeRO-2, 8 x 80 GB, bf16, batch 1, packed documents: longest context that fits "
        f"(<= {USABLE:.0%} of 80 GB per GPU) at sequence_parallel_size"
    )
    print(f"| family | {' | '.join(f'SP={s}' for s in sizes)} |")
    print(f"|---|{'---|' * len(sizes)}")
    sharded = {family: cls for family, cls in FAMILIES.items() if cls.sequence_parallel}
    for family, label, checkpointing in family_rows(sharded):
        cells = []
        for size in sizes:

            def peak(seq):
                cfg = run_config(dict(zero=2, batch=1, seq=seq, window=512, family=family), precision="bf16")
                if checkpointing:
                    cfg.draft.gradient_checkpointing = True
                return estimate_peak(config, cfg, world_size=8, sequence_parallel=size)

            longest = longest_that_fits(lambda seq: peak(seq).total, up_to=1 << 20)
            if longest:
                top = max(peak(longest).parts.items(), key=lambda kv: kv[1])
                cells.append(f"{longest // 1024}k ({top[0]} {top[1] / 1e9:.0f} GB)")
            else:
                cells.append("under 4k")
        print(f"| {label} | {' | '.join(cells)} |", flush=True)
