"""Read a Hugging Face target's input embeddings and lm_head straight from its checkpoint files.

Drafts need only these two tensors from the frozen target. Building the whole model to copy them
costs the full checkpoint in memory; here the config and the index say which file holds each
tensor, headers give shapes and dtypes, and only those two tensors are read.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError
from specdraft.target.checkpoint_files import TensorLocation, open_checkpoint, weight_files
from specdraft.target.config_file import read_target_config, target_config_path

# Most common layout first. When several are stored, the one matching the config's shape wins.
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",  # Gemma 3/4 multimodal, current layout
    "language_model.model.embed_tokens.weight",  # the same models, legacy hub layout
    "text_model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "text_model.lm_head.weight")


@dataclass
class TargetHeadWeights:
    """The two target tensors a draft shares.

    Without a cast they are, like transformers 5's own parameters, views of a private
    (copy-on-write) memory map of the checkpoint file: pages are read on first use, writes never
    reach the file, and ranks on one node share the physical pages. A cast makes a plain copy.
    """

    embed_tokens: torch.Tensor  # (vocab, hidden), CPU
    lm_head: torch.Tensor  # (vocab, hidden); the same object as embed_tokens when tied
    tied: bool
    embed_location: TensorLocation
    lm_head_location: TensorLocation


@dataclass(frozen=True)
class _HeadPlan:
    """Which stored tensors make up the embedding and the head, decided from metadata alone."""

    embed: TensorLocation
    lm_head: TensorLocation | None  # None: only the embedding is stored and the head is tied to it
    tied: bool  # what the config asks; a separately stored head stays separate if it differs


# ---------------------------------------------------------------------------- public entry points


def load_target_head_weights(
    target_dir, dtype=None, expected_vocab: int | None = None, expected_hidden: int | None = None
) -> TargetHeadWeights:
    """The target's input embeddings and lm_head on CPU, cast to `dtype` (None keeps the stored one).

    expected_vocab / expected_hidden are what the caller (a draft) needs; a mismatch is an error.
    """
    target_dir = _require_directory(target_dir)
    dtype = _resolve_dtype(dtype)
    config = read_target_config(target_dir)
    checkpoint = open_checkpoint(target_dir)
    plan = _plan_head(checkpoint, config, target_dir)
    for location in (plan.embed, plan.lm_head):
        if location is not None:
            _check_shape(location, (expected_vocab, expected_hidden), "the draft")

    embed = checkpoint.read(plan.embed, dtype)
    if plan.lm_head is None:
        return TargetHeadWeights(embed, embed, True, plan.embed, plan.embed)
    lm_head = checkpoint.read(plan.lm_head, dtype)
    # transformers ties a stored head only when it equals the embedding (.bin files store both).
    if plan.tied and torch.equal(embed, lm_head):
        return TargetHeadWeights(embed, embed, True, plan.embed, plan.embed)
    return TargetHeadWeights(embed, lm_head, False, plan.embed, plan.lm_head)


def load_target_tensors(target_dir, prefix: str, dtype=None) -> dict[str, torch.Tensor]:
    """{key: tensor} of the stored tensors whose key starts with `prefix` (a native MTP layer's
    "mtp.", which transformers' loader drops), read one at a time on CPU; {} when none."""
    checkpoint, dtype = open_checkpoint(_require_directory(target_dir)), _resolve_dtype(dtype)
    return {
        key: checkpoint.read(checkpoint.location(key), dtype)
        for key in sorted(checkpoint.weight_map)
        if key.startswith(prefix)
    }


def target_weight_files(target_dir) -> dict[str, Path]:
    """{tensor key: the file holding it} of the target's weights (headers and index only)."""
    return dict(open_checkpoint(_require_directory(target_dir)).weight_map)


def describe_target(target_dir) -> dict:
    """Architecture, sizes and where the embedding and head live, from config and headers only."""
    target_dir = _require_directory(target_dir)
    config = read_target_config(target_dir)
    checkpoint = open_checkpoint(target_dir)
    plan = _plan_head(checkpoint, config, target_dir)
    text = _text_config(config)
    vocab_size, hidden_size = _config_shape(config)
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    return {
        "target_dir": str(target_dir),
        "architecture": architectures[0],
        "model_type": config.get("model_type"),
        "num_layers": text.get("num_hidden_layers", config.get("num_hidden_layers")),
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "tied": plan.tied,
        "weights": str(checkpoint.source),
        "weight_files": len(set(checkpoint.weight_map.values())),
        "embed_tokens": asdict(plan.embed),
        "lm_head": asdict(plan.lm_head or plan.embed),
    }


def format_target_description(desc: dict) -> str:
    """describe_target's dict as aligned lines for a terminal."""
    lines = [
        f"target        {desc['target_dir']}",
        f"architecture  {desc['architecture']} (model_type {desc['model_type']})",
        f"sizes         {desc['num_layers']} layers, hidden {desc['hidden_size']}, vocab {desc['vocab_size']}",
        f"weights       {Path(desc['weights']).name} ({desc['weight_files']} file(s))",
        "embed_tokens  " + _format_location(desc["embed_tokens"]),
    ]
    if desc["tied"] and desc["lm_head"] == desc["embed_tokens"]:
        lines.append("lm_head       tied to embed_tokens (no separate tensor stored)")
    else:
        tied_note = "  (config ties it to embed_tokens)" if desc["tied"] else ""
        lines.append("lm_head       " + _format_location(desc["lm_head"]) + tied_note)
    return "\n".join(lines)


def _format_location(location: dict) -> str:
    shape = "x".join(str(size) for size in location["shape"])
    return f"{location['key']}  {shape}  {location['dtype']}  in {Path(location['file']).name}"


# ----------------------------------------------------------------------------- config and plan


def _require_directory(target_dir) -> Path:
    path = Path(target_dir)
    if not path.is_dir():
        raise SpecdraftError(f"{path}: target directory does not exist")
    return path


def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise SpecdraftError(f"unknown dtype {dtype!r} (expected a torch dtype name such as 'bfloat16')")
    return resolved


def _text_config(config: dict) -> dict:
    # config.json as a dict: this reader runs without transformers (drafts/base.target_text_config
    # is the lookup for config objects)
    text = config.get("text_config")
    return text if isinstance(text, dict) else {}


def _config_shape(config: dict) -> tuple[int | None, int | None]:
    """(vocab, hidden): multimodal wrappers keep both in text_config."""
    text = _text_config(config)
    return (text.get("vocab_size", config.get("vocab_size")), text.get("hidden_size", config.get("hidden_size")))


def _tie_word_embeddings(config: dict, target_dir: Path) -> bool | None:
    """The config's tie flag; the wrapper (top level) owns lm_head, so it is asked first.

    None when neither config.json nor transformers' default for the model type says.
    """
    for section in (config, _text_config(config)):
        if "tie_word_embeddings" in section:
            return bool(section["tie_word_embeddings"])
    return _default_tie_word_embeddings(target_dir)


def _default_tie_word_embeddings(target_dir: Path) -> bool | None:
    # The default differs per model type (Llama/Qwen False, Gemma True); transformers knows it.
    # Imported here: only a config.json without the flag pays for importing transformers.
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target_dir)
    except (ValueError, KeyError, OSError):  # a model type this transformers does not know
        return None
    for section in (config, config.get_text_config()):
        flag = getattr(section, "tie_word_embeddings", None)
        if flag is not None:
            return bool(flag)
    return None


def _plan_head(checkpoint, config: dict, target_dir: Path) -> _HeadPlan:
    expected = _config_shape(config)
    embed = _find_tensor(checkpoint, EMBED_KEYS, expected)
    lm_head = _find_tensor(checkpoint, LM_HEAD_KEYS, expected)
    tied = _tie_word_embeddings(config, target_dir)
    if tied is None:
        tied = lm_head is None  # unknown model type: a checkpoint without a head ties it
    if embed is None and (lm_head is None or not tied):
        raise SpecdraftError(f"{checkpoint.source}: no input-embedding tensor (looked for {', '.join(EMBED_KEYS)})")
    if lm_head is None and not tied:
        raise SpecdraftError(
            f"{checkpoint.source}: config.json does not tie word embeddings but no "
            f"lm_head tensor is stored (looked for {', '.join(LM_HEAD_KEYS)})"
        )
    if embed is None:
        embed, lm_head = lm_head, None  # transformers ties a missing embedding to the stored head
    for location in (embed, lm_head):
        if location is not None:
            _check_shape(location, expected, str(target_config_path(target_dir)))
    return _HeadPlan(embed, lm_head, tied)


def _find_tensor(checkpoint, candidates: tuple[str, ...], expected) -> TensorLocation | None:
    present = [checkpoint.location(key) for key in candidates if key in checkpoint.weight_map]
    matching = [location for location in present if _shape_matches(location.shape, expected)]
    return (matching or present or [None])[0]


def _shape_matches(shape: tuple[int, ...], expected) -> bool:
    return len(shape) == 2 and all(want is None or have == want for have, want in zip(shape, expected))


def _check_shape(location: TensorLocation, expected, source: str) -> None:
    if not _shape_matches(location.shape, expected):
        wanted = ", ".join("any" if size is None else str(size) for size in expected)
        raise SpecdraftError(
            f"{location.file}: {location.key} has shape {location.shape} but {source} "
            f"expects (vocab, hidden) = ({wanted})"
        )


# ------------------------------------------------------------------------------------ identity


IDENTITY_BLOCKS = 16  # blocks read per weight file for its identity ...
IDENTITY_BLOCK_BYTES = 4096  # ... of this size: ~64 KiB per file, whatever the model's size


def target_identity(target_dir) -> str:
    """A cheap fingerprint of a target's content: config.json's bytes, and per weight file its
    name, size and IDENTITY_BLOCKS blocks spread over it (header included).

    A moved or copied directory keeps it; weights swapped at the same path change it (new values
    change every block, even where shapes, headers and sizes are the same).
    """
    target_dir = _require_directory(target_dir)
    config = target_config_path(target_dir)
    if not config.is_file():
        raise SpecdraftError(f"{config}: missing (not a Hugging Face model directory)")
    digest = hashlib.sha256(config.read_bytes())
    for path in weight_files(target_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as file:
            for i in range(IDENTITY_BLOCKS):
                file.seek(size * i // IDENTITY_BLOCKS)
                digest.update(file.read(IDENTITY_BLOCK_BYTES))
    return digest.hexdigest()[:16]
