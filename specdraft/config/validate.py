"""Every check of a run's configuration, once, so the rest of the code can trust the values: the
training keys, the draft's family keys (each family validates its own), the target directory
against the sequences, sequence parallelism, the data files; a several-draft run checks each draft
as a run of its own would be checked, its errors naming `drafts.<name>.<key>`."""

from __future__ import annotations

import os
import re
from typing import List

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from specdraft.config.data_files import resolve_data_files
from specdraft.config.schema import (
    DRAFT_NAME,
    FEATURE_CACHE_DTYPES,
    FEATURE_CACHE_MODES,
    FP8_SCALES,
    PACKINGS,
    PER_DRAFT_KEYS,
    PRECISIONS,
    RESERVED_NAMES,
    TARGET_PLACEMENTS,
    _unknown_key_message,
    _validation_message,
)
from specdraft.config.several import draft_view
from specdraft.drafts import SPECS, check_family_keys, draft_family
from specdraft.drafts.objective_options import validate_objective_options
from specdraft.errors import SpecdraftError
from specdraft.parallel.checks import sequence_parallel_key_refusal
from specdraft.rundir.layout import step_of
from specdraft.target.checks import check_packed_documents, check_sequence_length, check_tokenizer, load_target_config
from specdraft.target.config_file import has_target_config


def _validate(
    cfg: DictConfig, source: str, draft_keys: List[str] = (), source_of=None, inputs_built: bool = True
) -> None:
    """inputs_built False: the target, data files and eval prompts are not built yet (`specdraft demo`
    checks its command line before it builds them): they are neither required nor read."""

    def fail(key: str, why: str) -> None:
        raise SpecdraftError(f"{source_of(key) if source_of else source}: key '{key}': {why}")

    for key in ("target", "data_files"):
        if OmegaConf.is_missing(cfg, key):
            fail(key, "is required")
    if cfg.precision == "fp16":
        # the chunked losses compute the draft's gradient in the forward pass, before DeepSpeed's
        # fp16 loss scale exists, so small gradients would underflow to zero in fp16
        fail(
            "precision",
            "fp16 is not supported for training (the chunked losses' gradients would underflow "
            "before loss scaling); use bf16",
        )
    if cfg.precision not in PRECISIONS:
        fail("precision", f"{cfg.precision!r} is not one of {', '.join(PRECISIONS)}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        fail("zero_stage", f"{cfg.zero_stage} is not one of 0, 1, 2, 3")
    if cfg.target_placement not in TARGET_PLACEMENTS:
        fail("target_placement", f"{cfg.target_placement!r} is not one of {', '.join(TARGET_PLACEMENTS)}")
    for key, allowed in (
        ("packing", PACKINGS),
        ("feature_cache_mode", FEATURE_CACHE_MODES),
        ("feature_cache_dtype", FEATURE_CACHE_DTYPES),
        ("feature_cache_fp8_scale", FP8_SCALES),
    ):
        if OmegaConf.select(cfg, key) not in allowed:
            fail(key, f"{OmegaConf.select(cfg, key)!r} is not one of {', '.join(allowed)}")
    family = draft_family(cfg.draft.type, source)
    check_family_keys(family, draft_keys, source)
    if cfg.feature_cache is not None:
        _check_feature_cache_keys(cfg, family, fail)
    for key in (
        "max_seq_length",
        "per_device_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "save_steps",
        "keep_last",
    ):
        if OmegaConf.select(cfg, key) < 1:
            fail(key, f"must be >= 1, got {OmegaConf.select(cfg, key)}")
    if cfg.loss_chunk_size < 0:
        fail("loss_chunk_size", f"must be >= 0 (0: sized from the vocab), got {cfg.loss_chunk_size}")
    if cfg.max_steps <= 0 and cfg.num_train_epochs < 1:
        fail("num_train_epochs", "must be >= 1 when max_steps is not set")
    if not 0.0 <= cfg.warmup_proportion < 1.0:
        fail("warmup_proportion", f"must be in [0, 1), got {cfg.warmup_proportion}")
    if cfg.learning_rate <= 0:
        fail("learning_rate", f"must be > 0, got {cfg.learning_rate}")
    validate_objective_options(cfg.draft, source, family.default_loss, lk_family=family.lk_loss)
    if cfg.eval_temperature < 0:
        fail("eval_temperature", f"must be >= 0, got {cfg.eval_temperature}")
    if inputs_built and not os.path.isdir(cfg.target):
        fail("target", f"directory not found: {cfg.target}")
    if cfg.draft.init_from is not None and not os.path.exists(cfg.draft.init_from):
        fail("draft.init_from", f"not found: {cfg.draft.init_from}")
    target_config = _target_config_if_readable(cfg.target) if inputs_built else None
    if target_config is not None:  # a model directory: it must hold a tokenizer and cover the sequences
        check_tokenizer(cfg.target, f"{source}: key 'target'")
        check_sequence_length(target_config, cfg.max_seq_length, source)
        check_packed_documents(target_config, cfg.document_mask, source)
    refusal = sequence_parallel_key_refusal(
        cfg.sequence_parallel_size, cfg.max_seq_length, target_config, family, cfg.draft, SPECS
    )
    if refusal:
        fail(*refusal)
    family.validate_config(cfg.draft, target_config, source, cfg.max_seq_length)
    for name in cfg.export_formats or ():
        if name not in family.serving_format_names:
            fail(
                "export_formats",
                f"{name!r} is not a serving format of draft.type {cfg.draft.type!r} "
                f"(it has: {', '.join(family.serving_format_names) or 'none besides native'})",
            )
    _normalise_resume(cfg)
    if not inputs_built:
        return
    resolve_data_files(cfg.data_files, source)
    if cfg.eval_steps > 0 and cfg.eval_prompts is not None and not os.path.isfile(cfg.eval_prompts):
        fail("eval_prompts", f"file not found: {cfg.eval_prompts}")  # read only when tau is measured


def _check_feature_cache_keys(cfg: DictConfig, family, fail) -> None:
    """A cache row is one conversation's features, computed with attention inside it from position 0."""
    if cfg.packing != "whole":
        fail("feature_cache", "a feature cache holds whole conversations; set packing: whole")
    if not cfg.document_mask:
        fail(
            "feature_cache",
            "a cached conversation was attended alone; without document_mask a window is one stream "
            "across conversations: set document_mask: true",
        )
    if family.moves_target_positions(cfg.draft):
        fail(
            "feature_cache",
            "this draft moves the target's positions per batch (GLIDE's anchor_offset); features "
            "cached at the conversation's own positions cannot serve it",
        )
    if cfg.feature_cache_mode == "hybrid" and cfg.sequence_parallel_size > 1:
        fail(
            "feature_cache_mode",
            "hybrid computes whole conversations to commit them; under sequence parallelism a rank "
            "holds a part of each: capture first (`specdraft capture`), then train offline",
        )
    if cfg.feature_cache_shard_tokens < cfg.max_seq_length:
        fail("feature_cache_shard_tokens", f"must be >= max_seq_length ({cfg.max_seq_length})")


def _normalise_resume(cfg: DictConfig) -> None:
    if str(cfg.resume).lower() in ("no", "false", "none", "off"):  # YAML reads a bare `no` as False
        cfg.resume = "no"


def _target_config_if_readable(target_dir: str):
    """The target's transformers config, for the draft's checks against it (layer ids, vocab);
    None when the directory has no config.json yet (training start fails on it with its own message)."""
    return load_target_config(target_dir) if has_target_config(target_dir) else None


def _validate_drafts(cfg: DictConfig, source: str, draft_keys: List[str], inputs_built: bool = True) -> None:
    """A several-draft run: the names, then each draft as a run of its own would be checked, its
    errors naming `drafts.<name>.<key>`."""
    if draft_keys:
        raise SpecdraftError(
            f"{source}: key 'drafts': give either draft: (one draft) or drafts: (several), not both "
            f"(draft.{draft_keys[0]} is set)"
        )
    if not isinstance(cfg.drafts, DictConfig) or len(cfg.drafts) == 0:
        raise SpecdraftError(f"{source}: key 'drafts': expected a mapping of draft names to draft sections")
    _normalise_resume(cfg)  # the run's own key, not only each draft's view of it
    seen = {}
    for name in cfg.drafts:
        name = str(name)
        if not DRAFT_NAME.fullmatch(name) or name.lower() in RESERVED_NAMES or step_of(name.lower()) is not None:
            raise SpecdraftError(
                f"{source}: key 'drafts.{name}': a draft name must be 1-64 letters, digits, '_' or "
                f"'-', starting with a letter or digit, neither step_<N> nor any of "
                f"{', '.join(RESERVED_NAMES)} "
                f"(it names the draft's folders)"
            )
        if name.lower() in seen:
            raise SpecdraftError(
                f"{source}: key 'drafts.{name}': the same folder name as drafts.{seen[name.lower()]} "
                f"on a case-insensitive filesystem"
            )
        seen[name.lower()] = name
        if not isinstance(cfg.drafts[name], DictConfig):
            raise SpecdraftError(f"{source}: key 'drafts.{name}': expected a draft section (type: and its keys)")
    for name in cfg.drafts:
        name = str(name)
        own = [str(k) for k in cfg.drafts[name] if str(k) not in PER_DRAFT_KEYS]
        try:
            view = draft_view(cfg, name)
            _validate(view, source, own, inputs_built=inputs_built)
        except ConfigKeyError as err:
            raise SpecdraftError(_as_draft_key(_unknown_key_message(err), name, source)) from None
        except ValidationError as err:
            raise SpecdraftError(_as_draft_key(_validation_message(err), name, source)) from None
        except (SpecdraftError, OmegaConfBaseException) as err:
            raise SpecdraftError(_as_draft_key(str(err).splitlines()[0], name, source)) from None
        family = draft_family(view.draft.type)
        if len(cfg.drafts) > 1 and family.moves_target_positions(view.draft):
            raise SpecdraftError(
                f"{source}: key 'drafts.{name}': this draft moves the target's positions per batch "
                f"(GLIDE's anchor_offset), and the drafts of one run share one target pass; "
                f"train it alone"
            )


def _as_draft_key(message: str, name: str, source: str) -> str:
    """An error about a draft's view, naming the key as the user wrote it: drafts.<name>.<key>."""
    message = re.sub(r"'draft\.", f"'drafts.{name}.", message)
    for key in PER_DRAFT_KEYS:
        message = message.replace(f"key '{key}'", f"key 'drafts.{name}.{key}'")
    return message if message.startswith(f"{source}:") else f"{source}: {message}"
