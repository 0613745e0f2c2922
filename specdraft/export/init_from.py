"""`draft.init_from`: a new run starts from an existing draft's weights. Its optimizer, scheduler
and step start fresh; `resume:` is what continues a run, and a run that resumes never imports
again (its checkpoint holds the draft it started from, trained since).

    planned_import(cfg, resuming, log)     before anything is written: find the files, tell their
                                           format, map the names to ours, check every tensor and
                                           setting against the draft this config builds (meta device)
    apply_import(draft, imported, data, log)   load them strictly; report what the run's data
                                               disagrees with (EAGLE-3's vocabulary)

The formats, told from the files:
    native       our export (config.json with architecture + dims), a run's step_<N>/, or a run
                 directory (its newest step_<N>/)
    speculators  config.json with speculators_model_type (eagle3, dflash, dspark, peagle, mtp)
                 + model.safetensors
    sglang       the EAGLE / SGLang layout: midlayer.*, fc, d2t, t2d (a .bin, .pth or safetensors)
    longspec     LongSpec's GLIDE draft_model_weights.pth (post_cross_attention_layernorm, ...)
Each format's names are its writer's (Draft.file_formats), read backwards: no second copy here.
A .bin / .pth is a pickle: it is read with torch.load(weights_only=True) and nothing else.
"""

from __future__ import annotations

import fnmatch
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig

from specdraft.drafts.base import Draft
from specdraft.drafts.registry import ARCHITECTURES, FAMILIES, build_draft
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import CONFIG_NAME, PTH_NAME, SAFETENSORS_NAME, exports
from specdraft.target.model import load_target_config

WEIGHT_FILES = (SAFETENSORS_NAME, "pytorch_model.bin", PTH_NAME)  # looked for in a directory, in this order
# the target's own tensors a file may carry beside the draft's (our speculators export writes
# embed_tokens; speculators' models hold the verifier's head and norm): the run reads the target's
# (a speculators P-EAGLE's embed_tokens gives its mask token's row: FileFormat.derived)
TARGET_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
# the tensors that tell the formats without a config of their own apart
FORMAT_MARKS = {"sglang": "midlayer.", "longspec": "post_cross_attention_layernorm.weight"}


@dataclass
class ImportedDraft:
    path: Path  # the weights file read
    fmt: str  # native | a name in the family's file_formats
    state: Dict[str, torch.Tensor]  # our names, checked against the run's draft


def planned_import(cfg: DictConfig, resuming: bool, log) -> Optional[ImportedDraft]:
    """The draft to start from, read and checked (None: no draft.init_from, or the run resumes)."""
    if cfg.draft.init_from is None:
        return None
    if resuming:
        log(
            f"draft.init_from: {cfg.draft.init_from} is not imported again: the run resumes from its own "
            f"checkpoint, which holds the draft it started from"
        )
        return None
    return read_init_from(cfg, load_target_config(cfg.target))


def read_init_from(cfg: DictConfig, target_config) -> ImportedDraft:
    weights, config = locate(Path(cfg.draft.init_from))
    tensors = read_tensors(weights)
    fmt, family = detect(weights, config, tensors)
    if family != cfg.draft.type:
        raise SpecdraftError(
            f"{weights}: a {family} draft ({fmt} files); this run trains draft.type "
            f"{cfg.draft.type!r} (set draft.type: {family})"
        )
    with torch.device("meta"):  # shapes and names only: nothing is allocated
        draft = build_draft(cfg.draft, target_config)
    check_settings(draft, fmt, config, weights)
    names, implied = format_names(draft, fmt)
    check_tensors(draft, names, tensors, weights)
    state = {ours: tensors[theirs] for theirs, ours in names.items() if ours is not None}
    if fmt != "native":
        state.update(type(draft).file_formats[fmt].derived(draft, tensors))
    return ImportedDraft(weights, fmt, {**state, **implied})


def apply_import(draft: Draft, imported: ImportedDraft, data, log) -> None:
    """Load the checked tensors into the run's new draft (before the engine is built)."""
    draft.load_state_dict(imported.state, strict=True)
    log(
        f"draft.init_from: {imported.fmt} draft {imported.path} ({len(imported.state)} tensors); "
        f"optimizer, scheduler and step start fresh"
    )
    disagreement = draft.data_disagreement(data)
    if disagreement:
        log(f"draft.init_from: {disagreement}")


# -- the files ---------------------------------------------------------------------------------------


def locate(path: Path) -> Tuple[Path, Optional[Dict[str, Any]]]:
    """(the weights file, the config.json beside it or None) of a file, an export or a run."""
    if path.is_file():
        return path, read_json(path.parent / CONFIG_NAME)
    if not (path / CONFIG_NAME).is_file():
        steps = [d for d in exports(path) if (d / CONFIG_NAME).is_file()]
        path = steps[-1] if steps else path  # a run directory: its newest export
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name, read_json(path / CONFIG_NAME)
    raise SpecdraftError(
        f"{path}: no draft weights there ({', '.join(WEIGHT_FILES)}), and not a run directory with step_<N>/ exports"
    )


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecdraftError(f"{path}: not readable JSON ({err})") from None
    return config if isinstance(config, dict) else None


def read_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """{name: tensor} of a safetensors file, or of a pickle that holds tensors only."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for a damaged file
            raise SpecdraftError(f"{path}: not a readable safetensors file ({one_line(err)})") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
    except pickle.UnpicklingError as err:
        raise SpecdraftError(
            f"{path}: refused: the pickle asks for more than tensors, and it is read with "
            f"torch.load(weights_only=True) only ({one_line(err)})"
        ) from None
    except Exception as err:  # a truncated zip, not a torch file at all
        raise SpecdraftError(f"{path}: not a readable torch file ({type(err).__name__}: {one_line(err)})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in loaded.items()):
        raise SpecdraftError(f"{path}: expected a state dict (tensor names to tensors), found {type(loaded).__name__}")
    return dict(loaded)


def one_line(err: BaseException) -> str:
    """The telling line of an exception's message (torch's weights_only refusal spans many)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    telling = [line for line in lines if "Unsupported global" in line or "WeightsUnpickler" in line]
    return ((telling or lines or [type(err).__name__])[0])[:300]


def detect(weights: Path, config: Optional[Dict[str, Any]], tensors: Dict[str, torch.Tensor]) -> Tuple[str, str]:
    """(format, draft family) of the files."""
    if config is not None and "architecture" in config and "dims" in config:
        cls = ARCHITECTURES.get(config["architecture"])
        if cls is None:
            raise SpecdraftError(
                f"{weights.parent / CONFIG_NAME}: unknown draft architecture {config['architecture']!r}"
            )
        return "native", cls.family
    if config is not None and "speculators_model_type" in config:
        family = str(config["speculators_model_type"])
        if "speculators" not in getattr(FAMILIES.get(family), "file_formats", {}):
            raise SpecdraftError(
                f"{weights.parent / CONFIG_NAME}: speculators_model_type {family!r}: specdraft reads "
                f"speculators drafts of {', '.join(f for f, _ in with_format('speculators'))} only"
            )
        return "speculators", family
    for fmt, mark in FORMAT_MARKS.items():
        if any(name.startswith(mark) for name in tensors):
            return fmt, with_format(fmt)[0][0]
    shown = ", ".join(sorted(tensors)[:4])
    raise SpecdraftError(
        f"{weights}: not a draft format specdraft reads (tensors {shown}, ...): expected our "
        f"export, a speculators export, the EAGLE / SGLang layout (midlayer.*) or LongSpec's GLIDE"
    )


def with_format(fmt: str):
    """[(family, class)] of the families that read and write file format `fmt`."""
    return [(family, cls) for family, cls in FAMILIES.items() if fmt in cls.file_formats]


# -- the names and the checks ------------------------------------------------------------------------


def format_names(draft: Draft, fmt: str) -> Tuple[Dict[str, Optional[str]], Dict[str, torch.Tensor]]:
    """({the file's name: ours, or None for filler it writes and nobody reads}, {ours: value} of the
    tensors the format leaves out). The format's writer is run on placeholders, one object per name,
    and each one it passes through is ours."""
    ours = draft.state_dict()
    if fmt == "native":
        return {name: name for name in ours}, {}
    form = type(draft).file_formats[fmt]
    placeholders = {name: torch.zeros(0) for name in ours}
    by_id = {id(t): name for name, t in placeholders.items()}
    written = form.state_dict(draft, placeholders)
    return {theirs: by_id.get(id(t)) for theirs, t in written.items()}, form.implied(draft)


def check_settings(draft: Draft, fmt: str, config: Optional[Dict[str, Any]], source: Path) -> None:
    """What the files record of the draft (its layers, flags) must be this run's draft's too."""
    if fmt == "native":
        recorded = {key: config["dims"][key] for key in draft.import_settings if key in config["dims"]}
    else:
        recorded = type(draft).file_formats[fmt].settings(config)
    for key, value in recorded.items():
        ours = getattr(draft.dims, key)
        if plain(value) != plain(ours):
            raise SpecdraftError(
                f"{source}: the imported draft has draft.{key}={plain(value)}, this run's draft "
                f"{plain(ours)} (set draft.{key}: {plain(value)})"
            )


def plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def check_tensors(
    draft: Draft, names: Dict[str, Optional[str]], tensors: Dict[str, torch.Tensor], source: Path
) -> None:
    """Every tensor of the run's draft is there, with its shape and kind; nothing else is."""
    expected = draft.state_dict()
    for theirs in tensors:
        if theirs not in names and theirs not in TARGET_TENSORS:
            raise SpecdraftError(
                f"{source}: unexpected tensor {theirs!r}: this run's draft has no such tensor "
                f"({config_key(draft, theirs)})"
            )
    for theirs, ours in names.items():
        if ours is None:
            continue
        if theirs not in tensors:
            raise SpecdraftError(f"{source}: missing tensor {theirs!r} ({config_key(draft, ours)})")
        got, want = tensors[theirs], expected[ours]
        if got.shape != want.shape:
            raise SpecdraftError(
                f"{source}: tensor {theirs!r} has shape {tuple(got.shape)}, this run's draft needs "
                f"{tuple(want.shape)} ({config_key(draft, ours)})"
            )
        if got.is_floating_point() != want.is_floating_point() or (
            not want.is_floating_point() and got.dtype != want.dtype
        ):
            raise SpecdraftError(f"{source}: tensor {theirs!r} is {got.dtype}, this run's draft needs {want.dtype}")


def config_key(draft: Draft, name: str) -> str:
    """Which config key decides a tensor's shape or presence, as advice for the error line."""
    for pattern, key in draft.tensor_keys:
        if fnmatch.fnmatchcase(name, pattern):
            return f"set {key} to match the imported draft"
    return (
        "its shape comes from the target's config: the imported draft was made for another `target`, "
        "or another draft.* key of its family"
    )
