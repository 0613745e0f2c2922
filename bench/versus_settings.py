"""EAGLE-3 as speculators 0.9.0 trains it by default against specdraft's defaults, and the two ways
bench/versus.py runs them: "defaults" (each trainer as shipped) and "matched" (one recipe, set on
both sides as far as their options reach).

S: is speculators/ in .venv-speculators/lib/python3.11/site-packages (0.9.0), and a bare schema.py,
trainer.py, optimizers.py, data.py, dataloader.py is S:train/config/schema.py or S:train/<name>;
D: is specdraft/.
"matched" takes speculators' recipe wherever specdraft can express it, else the nearest setting
both express (AdamW with no weight decay: speculators' AdamW has torch's betas and eps and decays
every parameter, specdraft's decays matrices only).

| setting | speculators 0.9.0 default | specdraft default | matched |
|---|---|---|---|
| optimizer | Muon on 2D matrices + AdamW on the rest (S:train/config/schema.py:338-342; S:train/optimizers.py:86-113) | AdamW (D:train/engine.py:76-85) | AdamW both |
| learning rate | 1e-3, Muon group too (schema.py:344, :797-798) | 5e-4 (D:config/schema.py:74) | 5e-4 |
| weight decay | AdamW 0.01 on every parameter, norms included (schema.py:345-348; optimizers.py:79-83); Muon 0.1 (schema.py:358) | 0.1 on matrices only (D:config/schema.py:75; D:train/engine.py:97-102) | 0 both |
| AdamW betas, eps | torch defaults 0.9 / 0.999, 1e-8, not settable (optimizers.py:79-83) | 0.9 / 0.95, 1e-6 (D:config/schema.py:76-78) | 0.9 / 0.999, 1e-8 |
| LR schedule | linear warmup then linear decay to 0 (schema.py:371-373; S:train/trainer.py:417-423) | linear warmup then cosine to min_lr_ratio 0 (D:config/schema.py:82-84; D:train/schedule.py:24-29) | cosine, no warmup: then the two schedules give every update the same lr (a warmup would run one update later in speculators: transformers' schedule takes step 0 at lr 0, D:train/schedule.py:9-10) |
| warmup | 1% of the steps (trainer.py:205-206) | 10% (D:config/schema.py:82) | 0 |
| steps, epochs | 20 epochs (schema.py:391); --max-steps ends an epoch, and each later epoch trains one more step before it checks again (trainer.py:597-605, :736-744) | 1 epoch (D:config/schema.py:80-81) | max_steps both, within speculators' --epochs (RunShape.epochs) |
| batch | one packed sequence of --total-seq-len 8192 tokens per step, rows multipacked (schema.py:210-211; S:train/dataloader.py:66-73; longer rows cut, S:train/data.py:404-417) | 2 windows of max_seq_length 512 per step (D:config/schema.py:47, :72) | 1 window of T tokens = --total-seq-len T (the rows grouped differently: multipack vs best fit) |
| packing | whole rows packed, attention per document (data.py:434-445) | stream: conversations cut at window borders (D:config/schema.py:59) | packing whole (a feature cache needs it) |
| rows trained | 90%: train_data_ratio 0.9 holds 10% out for validation (schema.py:213-216; dataloader.py:129-130) | every row | every row: versus_features --val-rows copies + its train_data_ratio |
| TTT steps | 3 (schema.py:316-319) | 7 (D:drafts/eagle3/options.py:24) | 3 |
| TTT step weight | 1.0 per step (schema.py:321-324; S:losses/utils.py:51-61) | 0.8**k (D:drafts/eagle3/options.py:25) | 1.0 |
| loss | KL(target restricted to the draft vocab ‖ draft), mean over loss-masked tokens per step, summed over steps (schema.py:806, :634; S:losses/eager.py:11-30; S:losses/utils.py:269-304; S:models/eagle3/core.py:309-320) | soft CE against the same teacher (same gradient as KL), per-step mean, decayed sum (D:drafts/eagle3/options.py:71; D:drafts/eagle3/model.py:210-236) | draft.loss kl |
| rows the teacher teaches | every loss-masked token (S:models/eagle3/metrics.py:79-98) | in_vocab: only where the target's top-1 is a draft token (D:drafts/eagle3/options.py:30-33) | teacher_rows all |
| norm_before_residual | true (schema.py:145-148) | false (D:drafts/eagle3/options.py:26) | true |
| norm_before_fc | true for eagle3 (schema.py:154-160, :791-792) | false (D:drafts/eagle3/options.py:28) | true |
| norm_output | true for eagle3 (schema.py:166-171, :793-794) | false (D:drafts/eagle3/options.py:29) | true |
| fc_norm | false (schema.py:161-165) | false (D:drafts/eagle3/options.py:27) | equal |
| draft vocab | the whole target vocab unless --draft-vocab-size N and a token_freq.pt / d2t-N.npy (schema.py:129-133; S:train/cli.py:398-447) | 32000, or the whole vocab when smaller (D:drafts/eagle3/options.py:23; D:drafts/eagle3/layer.py:30) | N both, the maps versus_features writes (specdraft counts the same rows the same way) |
| lm_head | the target's lm_head rows of the draft vocab, frozen (S:model.py:66-71, :172-185, :207) | random N(0, initializer_range), trained (D:drafts/eagle3/layer.py:186, :191; D:drafts/base.py:245-254) | not expressible: specdraft trains its head (draft.init_from speculators' --dry-run checkpoint starts both from the same weights, head included) |
| draft attention | every draft layer sliding window 2048 (schema.py:172-183; S:train/cli.py:211-214) | full causal | --full-attention-indices 0 |
| target layers | [2, L//2, L-3], refused when not distinct (S:models/utils.py:99-140) | the same, or three spread ids on a shallow target (D:drafts/eagle3/layer.py:33-45) | the ids given to both |
| precision | bf16 autocast, fp32 master weights (schema.py:218-223; trainer.py:539-540) | fp32 (D:config/schema.py:92) | fp32 both |
| checkpoint dtype | bf16 whatever the training dtype (S:train/checkpointer.py:339-351) | the training dtype | not expressible (the export holds speculators' bf16 values) |
| gradient clipping | 1.0, fixed (trainer.py:551) | 1.0 (D:config/schema.py:79) | equal |
| input noise | none in 0.9.0: "noise" appears only as DFlash's name for MASK embeddings (S:models/dflash/core.py:415) | none | equal |
| embeddings | the target's, frozen (schema.py:149-153; S:model.py:63, :206) | the target's, frozen | equal |
| seed | 42 (schema.py:728) | 42 (D:config/schema.py:91) | equal (each draws its own init and order) |

On a CPU speculators also needs SPECULATORS_CPU_FLAGS (bench/speculators_train.py applies the device
patches): its fused losses need Triton ("Fused losses require Triton; use --loss-implementation
eager"), FlexAttention has no CPU backward ("FlexAttention does not support backward on CPU"), 12
spawned loader workers would share two cores, there is no vLLM to generate a missing row, and a
resume maps the checkpoint to "cuda:0". None of them changes what is trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

SPECULATORS_CPU_FLAGS = [
    "--loss-implementation", "eager",
    "--draft-attn-impl", "sdpa",
    "--num-workers", "0",
    "--on-missing", "raise",
    "--no-resume-from-checkpoint",
]  # fmt: skip

# the recipe each mode sets beyond the run's own values (RunShape); "defaults" sets nothing
SPECULATORS = {
    "defaults": [],
    "matched": [
        "--optimizer", "adamw",
        "--lr", "5e-4",
        "--weight-decay", "0",
        "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", "0",
        "--full-attention-indices", "0",
        "--hidden-states-dtype", "float32",
    ],
}  # fmt: skip
SPECDRAFT = {
    "defaults": [],
    "matched": [
        "learning_rate=5e-4",
        "weight_decay=0.0",
        "adam_beta1=0.9",
        "adam_beta2=0.999",
        "adam_eps=1e-8",
        "warmup_steps=0",
        "min_lr_ratio=0.0",
        "max_grad_norm=1.0",
        "per_device_batch_size=1",
        "gradient_accumulation_steps=1",
        "precision=fp32",
        "draft.ttt_steps=3",
        "draft.ttt_decay=1.0",
        "draft.loss=kl",
        "draft.teacher_rows=all",
        "draft.norm_before_residual=true",
        "draft.norm_before_fc=true",
        "draft.norm_output=true",
        "draft.fc_norm=false",
    ],
}


@dataclass
class RunShape:
    """What a comparison fixes for both trainers alike (versus_features.py's versus.json gives the
    vocabulary and train_data_ratio)."""

    target: str
    layers: List[int]  # the EAGLE-3 layer ids, vLLM's numbering
    steps: int
    seq_len: int  # specdraft's max_seq_length = speculators' --total-seq-len
    draft_vocab_size: int
    train_data_ratio: float
    # speculators' --epochs. Its --max-steps stops an epoch, not the run: every later epoch still
    # trains one step before it checks again (S:train/trainer.py:597-605 tests after the step;
    # run_training, :736-744, starts each epoch), so `steps` must fit in these epochs' batches
    epochs: int = 1


def speculators_argv(mode: str, run: RunShape, data_path, save_path) -> List[str]:
    """bench/speculators_train.py's arguments for one EAGLE-3 run on a CPU."""
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(run.target),
        "--data-path", str(data_path),
        "--save-path", str(save_path),
        "--log-dir", f"{save_path}/logs",
        "--target-layer-ids", *map(str, run.layers),
        "--draft-vocab-size", str(run.draft_vocab_size),
        "--train-data-ratio", repr(run.train_data_ratio),
        "--max-steps", str(run.steps),
        "--epochs", str(run.epochs),
        "--total-seq-len", str(run.seq_len),
        *SPECULATORS_CPU_FLAGS,
        *SPECULATORS[mode],
    ]  # fmt: skip


def specdraft_overrides(mode: str, run: RunShape) -> List[str]:
    """`specdraft train` key=value pairs for the same run (besides data_files, feature_cache, output_dir)."""
    return [
        f"target={run.target}",
        "draft.type=eagle3",
        f"draft.target_layers=[{','.join(map(str, run.layers))}]",
        f"draft.draft_vocab_size={run.draft_vocab_size}",
        f"max_steps={run.steps}",
        f"max_seq_length={run.seq_len}",
        "packing=whole",
        *SPECDRAFT[mode],
    ]
