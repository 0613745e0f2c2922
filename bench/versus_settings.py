"""Each family as speculators 0.9.0 trains it by default against specdraft's defaults, and the two
ways bench/versus.py runs them: "defaults" (each trainer as shipped) and "matched" (one recipe, set
on both sides as far as their options reach).

S: is speculators/ in .venv-speculators/lib/python3.11/site-packages (0.9.0), and a bare schema.py,
trainer.py, optimizers.py, data.py, dataloader.py is S:train/config/schema.py or S:train/<name>;
D: is specdraft/.
"matched" takes speculators' recipe wherever specdraft can express it, else the nearest setting
both express (AdamW with no weight decay: speculators' AdamW has torch's betas and eps and decays
every parameter, specdraft's decays matrices only).

DIFFERENCES holds the settings that differ, as rows (setting, speculators 0.9.0 default, specdraft
default, matched): "run" for every family (the optimizer, the schedule, the batch ...), then each
family's own; differences_table() writes them as the markdown table bench/versus.py reports.

What both trainers take alike in either mode (RunShape): the target, the rows, max_seq_length =
--total-seq-len, the target layer ids, the draft vocabulary, the steps (tokens seen) and the shape a
CPU budget sets (draft layers, anchors, Markov rank: `shape`).

The families compared are those both train and both measure (FAMILIES); NOT_COMPARED says why the
others are left out.

On a CPU speculators also needs SPECULATORS_CPU_FLAGS (bench/speculators_train.py applies the device
patches): its fused losses need Triton ("Fused losses require Triton; use --loss-implementation
eager"), FlexAttention has no CPU backward ("FlexAttention does not support backward on CPU"), 12
spawned loader workers would share two cores, there is no vLLM to generate a missing row, and a
resume maps the checkpoint to "cuda:0". None of them changes what is trained.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

FAMILIES = ("eagle3", "dflash", "dspark")
NOT_COMPARED = {
    "peagle": (
        "speculators 0.9.0 trains P-EAGLE on a CPU (--draft-arch llama, as ours), but trains every row of "
        "its embedding table (S:models/peagle/config.py:35-44 embed_requires_grad default True; "
        "S:models/peagle/core.py:244-252 never passes the CLI's --embed-requires-grad): 184 of the tiny "
        "target's 512 rows differed from the target's after 3 steps. Our P-EAGLE keeps the target's "
        "embeddings and trains the mask row alone (D:drafts/peagle/model.py docstring), and an import "
        "keeps only that row (D:drafts/peagle/export.py mask_row): our decoder would measure another draft"
    ),
    "mtp": "needs a target with an MTP layer (the tiny and smollm2 targets have none)",
    "glide": "speculators has no GLIDE",
}

SPECULATORS_CPU_FLAGS = [
    "--loss-implementation", "eager",
    "--draft-attn-impl", "sdpa",
    "--num-workers", "0",
    "--on-missing", "raise",
    "--no-resume-from-checkpoint",
]  # fmt: skip

# the run's recipe each mode sets beyond the run's own values (RunShape), every family alike;
# "defaults" sets nothing. matched also gives every draft layer full attention (speculators_argv)
SPECULATORS = {
    "defaults": [],
    "matched": [
        "--optimizer", "adamw",
        "--lr", "5e-4",
        "--weight-decay", "0",
        "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", "0",
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
    ],
}
# each family's draft keys in matched mode: speculators' defaults, set on our side (speculators
# needs no flag for its own defaults; the MASK id, chosen by each differently, is passed to both)
FAMILY_SPECDRAFT = {
    "eagle3": [
        "draft.ttt_steps=3",
        "draft.ttt_decay=1.0",
        "draft.loss=kl",
        "draft.teacher_rows=all",
        "draft.norm_before_residual=true",
        "draft.norm_before_fc=true",
        "draft.norm_output=true",
        "draft.fc_norm=false",
        "draft.lm_head=target_frozen",
    ],
    "dflash": [
        "draft.block_size=16",
        "draft.sample_from_anchor=false",
        "draft.loss=ce",
        "draft.loss_weighting=dpace",
        "draft.dpace_alpha=0.5",
        "draft.loss_decay_gamma=4.0",
    ],
    "dspark": [
        "draft.block_size=8",
        "draft.sample_from_anchor=true",
        "draft.loss=kl",
        "draft.loss_weighting=decay",
        "draft.loss_decay_gamma=4.0",
        "draft.markov_head_type=vanilla",
        "draft.confidence_with_markov=true",
        "draft.confidence_loss_weight=1.0",
        "draft.confidence_temperature=1.0",
    ],
}
# draft decoder layers when the shape sets none: speculators' (S:train/config/schema.py:799-800) and
# ours (D:drafts/dflash/options.py:45; EAGLE-3 has one)
DEFAULT_DRAFT_LAYERS = {"eagle3": 1, "dflash": 5, "dspark": 5}
# the shape keys both take, and speculators' flag for each
SHAPE_FLAGS = {"num_layers": "--num-layers", "max_anchors": "--max-anchors", "markov_rank": "--markov-rank"}
BLOCK_FAMILIES = ("dflash", "dspark")  # a MASK token; the whole target vocabulary (the target's lm_head)

RUN_ROWS = [
    ("optimizer", "Muon on 2D matrices + AdamW on the rest (S:train/config/schema.py:338-342; S:train/optimizers.py:86-113)", "AdamW (D:train/engine.py:76-85)", "AdamW both"),
    ("learning rate", "1e-3, Muon group too (schema.py:344, :797-798)", "5e-4 (D:config/schema.py:74)", "5e-4"),
    ("weight decay", "AdamW 0.01 on every parameter, norms included (schema.py:345-348; optimizers.py:79-83); Muon 0.1 (schema.py:358)", "0.1 on matrices only (D:config/schema.py:75; D:train/engine.py:97-102)", "0 both"),
    ("AdamW betas, eps", "torch defaults 0.9 / 0.999, 1e-8, not settable (optimizers.py:79-83)", "0.9 / 0.95, 1e-6 (D:config/schema.py:76-78)", "0.9 / 0.999, 1e-8"),
    ("LR schedule", "linear warmup then linear decay to 0 (schema.py:371-373; S:train/trainer.py:417-423)", "linear warmup then cosine to min_lr_ratio 0 (D:config/schema.py:82-84; D:train/schedule.py:24-29)", "cosine, no warmup: then the two schedules give every update the same lr (a warmup would run one update later in speculators: transformers' schedule takes step 0 at lr 0, D:train/schedule.py:9-10)"),
    ("warmup", "1% of the steps (trainer.py:205-206)", "10% (D:config/schema.py:82)", "0"),
    ("steps, epochs", "20 epochs (schema.py:391); --max-steps ends an epoch, and each later epoch trains one more step before it checks again (trainer.py:597-605, :736-744)", "1 epoch (D:config/schema.py:80-81)", "both modes: the steps of the same tokens, within speculators' --epochs (RunShape.epochs)"),
    ("batch", "one packed sequence of --total-seq-len 8192 tokens per step, rows multipacked (schema.py:210-211; S:train/dataloader.py:66-73; longer rows cut, S:train/data.py:404-417)", "2 windows of max_seq_length 512 per step (D:config/schema.py:47, :72)", "both modes: --total-seq-len = max_seq_length T; matched: 1 window of T a step on ours too (the rows grouped differently: multipack vs best fit)"),
    ("packing", "whole rows packed, attention per document (data.py:434-445)", "whole rows packed best fit, attention per document (D:config/schema.py:59; D:data/whole_packing.py)", "equal (both modes set packing whole: a feature cache needs it)"),
    ("rows trained", "90%: train_data_ratio 0.9 holds 10% out for validation (schema.py:213-216; dataloader.py:129-130)", "every row", "both modes: every row (versus_features --val-rows copies + its train_data_ratio)"),
    ("draft attention", "every draft layer sliding window 2048 (schema.py:172-183; S:train/cli.py:211-214)", "full causal", "--full-attention-indices: every draft layer"),
    ("precision", "bf16 autocast, fp32 master weights (schema.py:218-223; trainer.py:539-540)", "fp32 (D:config/schema.py:92)", "fp32 both"),
    ("checkpoint dtype", "bf16 whatever the training dtype (S:train/checkpointer.py:339-351)", "the training dtype", "not expressible (the export holds speculators' bf16 values)"),
    ("gradient clipping", "1.0, fixed (trainer.py:551)", "1.0 (D:config/schema.py:79)", "equal"),
    ("input noise", "none in 0.9.0: \"noise\" appears only as DFlash's name for MASK embeddings (S:models/dflash/core.py:415)", "none", "equal"),
    ("embeddings", "the target's, frozen (schema.py:149-153; S:model.py:63, :206)", "the target's, frozen", "equal"),
    ("seed", "42 (schema.py:728)", "42 (D:config/schema.py:91)", "equal (each draws its own init and order)"),
]  # fmt: skip
DIFFERENCES = {
    "run": RUN_ROWS,
    "eagle3": [
        ("TTT steps", "3 (schema.py:316-319)", "7 (D:drafts/eagle3/options.py:24)", "3"),
        ("TTT step weight", "1.0 per step (schema.py:321-324; S:losses/utils.py:51-61)", "0.8**k (D:drafts/eagle3/options.py:25)", "1.0"),
        ("loss", "KL(target restricted to the draft vocab ‖ draft), mean over loss-masked tokens per step, summed over steps (schema.py:806, :634; S:losses/eager.py:11-30; S:losses/utils.py:269-304; S:models/eagle3/core.py:309-320)", "soft CE against the same teacher (same gradient as KL), per-step mean, decayed sum (D:drafts/eagle3/options.py:71; D:drafts/eagle3/train.py:94-120)", "draft.loss kl"),
        ("rows the teacher teaches", "every loss-masked token (S:models/eagle3/metrics.py:79-98)", "in_vocab: only where the target's top-1 is a draft token (D:drafts/eagle3/options.py:30-33)", "teacher_rows all"),
        ("norm_before_residual", "true (schema.py:145-148)", "false (D:drafts/eagle3/options.py:26)", "true"),
        ("norm_before_fc", "true for eagle3 (schema.py:154-160, :791-792)", "false (D:drafts/eagle3/options.py:28)", "true"),
        ("norm_output", "true for eagle3 (schema.py:166-171, :793-794)", "false (D:drafts/eagle3/options.py:29)", "true"),
        ("fc_norm", "false (schema.py:161-165)", "false (D:drafts/eagle3/options.py:27)", "equal"),
        ("draft vocab", "the whole target vocab unless --draft-vocab-size N and a token_freq.pt / d2t-N.npy (schema.py:129-133; S:train/cli.py:398-447)", "32000, or the whole vocab when smaller (D:drafts/eagle3/options.py:23; D:drafts/eagle3/layer.py:30)", "both modes: N, the maps versus_features writes (specdraft counts the same rows the same way)"),
        ("lm_head", "the target's lm_head rows of the draft vocab, frozen (S:model.py:66-71, :172-185, :207)", "own: random N(0, initializer_range), trained (D:drafts/eagle3/options.py:34-36; D:drafts/eagle3/layer.py:194, :191)", "draft.lm_head target_frozen"),
        ("target layers", "[2, L//2, L-3], refused when not distinct (S:models/utils.py:99-140)", "the same, or three spread ids on a shallow target (D:drafts/eagle3/layer.py:33-45)", "both modes: ours, given to both"),
    ],
    "dflash": [
        ("block size", "16 for dflash (schema.py:460-464, :638, :807-808)", "8 (D:drafts/dflash/options.py:46)", "16"),
        ("loss", "CE against the target's argmax (schema.py:634-636, :805-806; S:losses/eager.py:92-106)", "CE against the data's next token (D:drafts/dflash/train.py:165-166)", "ce both; the labels not expressible (equal where the data is the target's own greedy answers, the presets' data)"),
        ("per-position weight", "D-PACE, alpha 0.5 (schema.py:473-481, :801-804)", "exp(-j / 4) decay (D:drafts/dflash/options.py:48-50)", "dpace, alpha 0.5"),
        ("MASK token", "the tokenizer's mask token, an added <|MASK|> if the embedding has a free row, else pad / eos / unk (S:train/utils.py:16-62)", "the last id of the vocabulary (D:drafts/dflash/options.py:52; D:drafts/dflash/model.py:127)", "the last id, passed to both"),
        ("draft layers, anchors", "5 qwen3 layers (schema.py:93-104, :789-800), 512 anchors (schema.py:226-230)", "5 layers shaped as the target's, 512 anchors (D:drafts/dflash/options.py:45, :51)", "both modes: the preset's CPU shape (num_layers, max_anchors)"),
        ("draft vocab", "the whole target vocab without --draft-vocab-size (S:train/cli.py:420-437)", "the whole target vocab: the target's lm_head (D:drafts/dflash/export.py:86)", "equal"),
        ("target layers", "[2, L//2, L-3] (S:models/utils.py:99-140, via S:models/dflash/core.py:233-237)", "5 evenly spaced in 2..L-2, or 1..L-1 on a shallow target (D:drafts/dflash/options.py:58-70)", "both modes: ours, given to both"),
    ],
    "dspark": [
        ("sample from anchor", "true for dspark (schema.py:465-469; S:models/dflash/core.py:243-249)", "false (D:drafts/dflash/options.py:47)", "true"),
        ("loss", "KL to the target, every slot (schema.py:634-637, :805-806)", "0.9 TV + 0.1 CE (D:drafts/dspark/options.py:13)", "draft.loss kl"),
        ("per-position weight", "exp(-j / 4) (schema.py:470-476, :801-804)", "exp(-j / 4) (D:drafts/dflash/options.py:48-49)", "equal"),
        ("Markov head", "rank 256, vanilla (schema.py:511-518)", "rank 256, vanilla (D:drafts/dspark/options.py:20-21)", "both modes: the preset's CPU rank"),
        ("confidence head", "with the Markov row, BCE to 1 - TV, weight 1.0 (schema.py:519-531; S:models/dspark/metrics.py:1-10, :107-117)", "the same (D:drafts/dspark/options.py:22-25)", "equal"),
        ("MASK token", "as DFlash (S:train/utils.py:16-62)", "the last id (D:drafts/dflash/options.py:52)", "the last id, passed to both"),
        ("draft layers, anchors", "5 qwen3 layers, 512 anchors (schema.py:93-104, :226-230)", "5 layers, 512 anchors", "both modes: the preset's CPU shape"),
        ("target layers", "[2, L//2, L-3] (S:models/utils.py:99-140)", "as DFlash (D:drafts/dflash/options.py:58-70)", "both modes: ours, given to both"),
    ],
}  # fmt: skip


def differences_table(family: str) -> List[str]:
    """The markdown rows of the settings that differ for one family: the run's, then its own."""
    lines = ["| setting | speculators 0.9.0 default | specdraft default | matched |", "|---|---|---|---|"]
    for row in [*DIFFERENCES["run"], *DIFFERENCES[family]]:
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return lines


@dataclass
class RunShape:
    """What a comparison fixes for both trainers alike (versus_features.py's versus.json gives the
    vocabulary and train_data_ratio)."""

    target: str
    layers: List[int]  # the draft's layer ids, vLLM's numbering
    steps: int
    seq_len: int  # specdraft's max_seq_length = speculators' --total-seq-len
    draft_vocab_size: Optional[int]  # None: the whole target vocabulary (DFlash and DSpark always)
    train_data_ratio: float
    # speculators' --epochs. Its --max-steps stops an epoch, not the run: every later epoch still
    # trains one step before it checks again (S:train/trainer.py:597-605 tests after the step;
    # run_training, :736-744, starts each epoch), so `steps` must fit in these epochs' batches
    epochs: int = 1
    family: str = "eagle3"
    shape: Dict[str, int] = field(default_factory=dict)  # SHAPE_FLAGS keys: the CPU budget, both sides
    # speculators' --scheduler-total-steps: a run stopped at `steps` of a schedule this long is the
    # first `steps` updates of the longer run (the same seed, batches and lr at every step)
    schedule_steps: Optional[int] = None
    mask_token_id: Optional[int] = None  # matched, DFlash and DSpark: the MASK row both embed

    @property
    def draft_layers(self) -> int:
        return int(self.shape.get("num_layers", DEFAULT_DRAFT_LAYERS[self.family]))


def speculators_argv(mode: str, run: RunShape, data_path, save_path) -> List[str]:
    """bench/speculators_train.py's arguments for one run on a CPU."""
    argv = [
        "--speculator-type", run.family,
        "--verifier-name-or-path", str(run.target),
        "--data-path", str(data_path),
        "--save-path", str(save_path),
        "--log-dir", f"{save_path}/logs",
        "--target-layer-ids", *map(str, run.layers),
        "--train-data-ratio", repr(run.train_data_ratio),
        "--max-steps", str(run.steps),
        "--epochs", str(run.epochs),
        "--total-seq-len", str(run.seq_len),
        *SPECULATORS_CPU_FLAGS,
    ]  # fmt: skip
    if run.draft_vocab_size is not None:
        argv += ["--draft-vocab-size", str(run.draft_vocab_size)]
    if run.schedule_steps is not None:
        argv += ["--scheduler-total-steps", str(run.schedule_steps)]
    for key, value in sorted(run.shape.items()):
        argv += [SHAPE_FLAGS[key], str(value)]
    argv += SPECULATORS[mode]
    if mode == "matched":
        argv += ["--full-attention-indices", *map(str, range(run.draft_layers))]
        if run.family in BLOCK_FAMILIES and run.mask_token_id is not None:
            argv += ["--mask-token-id", str(run.mask_token_id)]
    return argv


def recipe_digest(family: str, mode: str) -> str:
    """Six hex digits of the recipe a mode sets on both sides: part names carry it, so a changed
    recipe trains again instead of reusing the parts of the old one."""
    recipe = [*SPECDRAFT[mode], *SPECULATORS[mode], *(FAMILY_SPECDRAFT[family] if mode == "matched" else [])]
    return hashlib.sha256("\n".join(recipe).encode()).hexdigest()[:6]


def specdraft_overrides(mode: str, run: RunShape) -> List[str]:
    """`specdraft train` key=value pairs for the same run (besides data_files, feature_cache, output_dir)."""
    keys = [
        f"target={run.target}",
        f"draft.type={run.family}",
        f"draft.target_layers=[{','.join(map(str, run.layers))}]",
        f"max_steps={run.steps}",
        f"max_seq_length={run.seq_len}",
        "packing=whole",
        *(f"draft.{key}={value}" for key, value in sorted(run.shape.items())),
        *SPECDRAFT[mode],
    ]
    if run.draft_vocab_size is not None:
        keys.append(f"draft.draft_vocab_size={run.draft_vocab_size}")
    if mode == "matched":
        keys += FAMILY_SPECDRAFT[run.family]
        if run.family in BLOCK_FAMILIES and run.mask_token_id is not None:
            keys.append(f"draft.mask_token_id={run.mask_token_id}")
    return keys
