"""The run configuration's schema: every key, its type, its default and what it means (the
configuration reference, docs/config-reference.md, is generated from these comments). Training keys
are top level (as in LongSpec's flat config); a draft's keys sit under `draft:` (DraftConfig: the
union of every family's options), several drafts under `drafts:`."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from specdraft.drafts import DraftConfig


PRECISIONS = ("fp32", "bf16")


TARGET_PLACEMENTS = ("auto", "replicated", "partitioned")
PACKINGS = ("stream", "whole")
FEATURE_CACHE_MODES = ("offline", "hybrid")
FEATURE_CACHE_DTYPES = ("fp32", "bf16", "fp8")
FP8_SCALES = ("token", "token_layer")


@dataclass
class WandbConfig:
    project: Optional[str] = None  # None: W&B off
    mode: str = "offline"  # offline needs no network; "online" syncs
    run_name: Optional[str] = None  # the W&B run's name; None: W&B picks one


@dataclass
class TrainConfig:
    target: str = "???"  # local HF directory of the frozen target (weights + tokenizer)
    data_files: Any = "???"  # jsonl / parquet: a path, a glob or a list of them
    eval_prompts: Optional[str] = None  # jsonl of prompts for tau every eval_steps
    # the chat template's enable_thinking (Qwen3-style templates) for the data and the eval prompts,
    # as the server is run; None: the template's default
    thinking: Optional[bool] = None
    data_cache_dir: Optional[str] = None  # tokenised + packed data; default $SPECDRAFT_HOME/data
    max_seq_length: int = 512  # tokens per packed training sequence
    # true: a row with nothing to learn (no assistant turn, template refusal, empty answers) or with
    # turns not trained yet (a tool turn, null content) stops the data build naming file:line;
    # false: it is skipped and counted in the start-up summary
    data_strict: bool = False
    # packed conversations: positions restart and attention stops at each conversation border
    # (target and draft); false: a window is one stream across borders (LongSpec's packing)
    document_mask: bool = True
    # how conversations fill the max_seq_length windows. stream: the conversations joined and cut at
    # every window border (a cut one goes on in the next window as a new document, without its
    # prompt); whole: each conversation whole in one window, best fit, one longer than a window
    # truncated at its end, each window's tail padding (a document of its own, no labels)
    packing: str = "whole"
    # a feature cache (`specdraft capture` writes it): the target's features are read from it
    # instead of computed; needs packing: whole and document_mask: true. None: the target runs
    feature_cache: Optional[str] = None
    # offline: every row must be in the cache and the target's layers are never built (only its
    # embeddings and lm_head are read); hybrid: the target is built, rows missing from the cache
    # are computed in the first epoch and committed to it, later epochs read them
    feature_cache_mode: str = "offline"
    # what `specdraft capture` stores: fp32 | bf16 | fp8 (float8 e4m3 with float32 scales)
    feature_cache_dtype: str = "bf16"
    # fp8 scales: token (one per token across every stored layer, as speculators) | token_layer
    feature_cache_fp8_scale: str = "token"
    feature_cache_shard_tokens: int = 16384  # tokens per shard file of the cache (~0.5 GB at H 4096, bf16, 4 layers)
    per_device_batch_size: int = 2  # sequences per rank per micro step
    gradient_accumulation_steps: int = 1  # micro steps per optimizer step
    learning_rate: float = 5e-4  # AdamW peak learning rate (LongSpec's)
    weight_decay: float = 0.1  # applied to matrices only, never to norms
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-6  # AdamW epsilon
    max_grad_norm: float = 1.0  # 0 disables clipping
    num_train_epochs: int = 1  # used when max_steps <= 0
    max_steps: int = -1  # optimizer steps; overrides num_train_epochs when > 0
    warmup_proportion: float = 0.1  # linear warmup over this share of the steps ...
    warmup_steps: int = -1  # ... unless given in steps here
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio
    logging_steps: int = 10  # metrics.jsonl / TensorBoard / progress bar every N steps
    save_steps: int = 200  # checkpoint + draft export every N steps (and at the end)
    eval_steps: int = -1  # tau on eval_prompts every N steps; <= 0 disables
    eval_temperature: float = 0.0  # the in-training tau's sampling temperature (0: greedy)
    # committed checkpoint slots kept under ckpt/ (2 = LongSpec's last_ds/last_2ds); the step_<N>/
    # draft exports are all kept (the curve a user picks a draft from)
    keep_last: int = 2
    resume: str = "auto"  # auto: newest committed slot; no; or a slot / run directory path
    seed: int = 42  # data order, per-batch randomness and initial weights; a resume keeps it
    precision: str = "fp32"  # fp32 | bf16 (fp16 is refused: the chunked losses' gradients would underflow)
    zero_stage: int = 2  # DeepSpeed ZeRO stage 0-3
    # ZeRO-3: the frozen target "replicated" on every device (no gathers), "partitioned" (for
    # targets that do not fit), or "auto": replicated when the memory model says it fits
    target_placement: str = "auto"
    # ranks sharing each sequence (Ulysses sequence parallelism): T / N tokens each; divides the
    # world size, max_seq_length and the target's attention heads
    sequence_parallel_size: int = 1
    loss_chunk_size: int = 0  # tokens per cross-entropy chunk; 0: from the vocab (~256 MiB fp32 logits)
    output_dir: str = "runs/default"  # the run directory: config.yaml, ckpt/, step_<N>/ exports, metrics
    # serving formats each save writes beside native; None: the family's formats that can serve the
    # draft as trained, less the on-request ones (GLIDE's longspec, MTP's stitched), written only
    # when named here or by `specdraft export --format`
    export_formats: Optional[List[str]] = None
    draft: DraftConfig = field(default_factory=DraftConfig)
    # several drafts trained from one target pass: {name: the keys of a `draft:` section, plus any of
    # learning_rate, weight_decay, adam_beta1, adam_beta2, adam_eps, max_grad_norm, warmup_proportion,
    # warmup_steps, min_lr_ratio, export_formats for that draft alone}; None: the one `draft:` above
    # ([several drafts](training.md#sweep-the-families-in-one-run-drafts))
    drafts: Optional[Dict[str, Any]] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)


# the keys a draft of a several-draft run may set for itself; the rest of the run is shared
PER_DRAFT_KEYS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "max_grad_norm",
    "warmup_proportion",
    "warmup_steps",
    "min_lr_ratio",
    "export_formats",
)


DRAFT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a folder name on every filesystem


RESERVED_NAMES = ("ckpt", "latest", "committed", "consolidated")  # names the run directory uses


def _all_keys(node: DictConfig, prefix: str = "") -> List[str]:
    keys = []
    for key in node.keys():
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        child = OmegaConf.select(node, str(key), throw_on_missing=False)
        if isinstance(child, DictConfig):
            keys.extend(_all_keys(child, dotted + "."))
    return keys


def _unknown_key_message(err: ConfigKeyError) -> str:
    key = err.full_key or str(getattr(err, "key", ""))
    known = _all_keys(OmegaConf.structured(TrainConfig))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown key '{key}'{hint}"


def _validation_message(err: ValidationError) -> str:
    schema_type = TrainConfig
    for part in str(err.full_key).split("."):
        hints = typing.get_type_hints(schema_type) if dataclasses.is_dataclass(schema_type) else {}
        schema_type = hints.get(part)
    expected = getattr(schema_type, "__name__", None) or str(schema_type).replace("typing.", "")
    return f"key '{err.full_key}': value {err.value!r} is not a valid {expected}"
