"""Read a Hugging Face target's input embeddings and lm_head straight from its checkpoint files.

Drafts need only these two tensors from the frozen target. Building the whole model to copy them
costs the full checkpoint in memory; here the config and the index say which file holds each
tensor, headers give shapes and dtypes, and only those two tensors are read.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdraft.errors import SpecdraftError
from specdraft.target.config_file import read_json, read_target_config, target_config_path

# Most common layout first. When several are stored, the one matching the config's shape wins.
EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",  # Gemma 3/4 multimodal, current layout
    "language_model.model.embed_tokens.weight",  # the same models, legacy hub layout
    "text_model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "text_model.lm_head.weight")

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
PYTORCH_INDEX = "pytorch_model.bin.index.json"
PYTORCH_FILE = "pytorch_model.bin"

# safetensors header dtype -> torch dtype name, so both formats describe tensors alike.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
_HEADER_LENGTH_BYTES = 8  # u64 little-endian length of the JSON header


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor lives in a checkpoint, known without reading its data."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str  # torch name as stored, e.g. "bfloat16"


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


def load_target_head_weights(target_dir, dtype=None, expected_vocab: int | None = None,
                             expected_hidden: int | None = None) -> TargetHeadWeights:
    """The target's input embeddings and lm_head on CPU, cast to `dtype` (None keeps the stored one).

    expected_vocab / expected_hidden are what the caller (a draft) needs; a mismatch is an error.
    """
    target_dir = _require_directory(target_dir)
    dtype = _resolve_dtype(dtype)
    config = read_target_config(target_dir)
    checkpoint = _open_checkpoint(target_dir)
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
    checkpoint, dtype = _open_checkpoint(_require_directory(target_dir)), _resolve_dtype(dtype)
    return {key: checkpoint.read(checkpoint.location(key), dtype)
            for key in sorted(checkpoint.weight_map) if key.startswith(prefix)}


def target_weight_files(target_dir) -> dict[str, Path]:
    """{tensor key: the file holding it} of the target's weights (headers and index only)."""
    return dict(_open_checkpoint(_require_directory(target_dir)).weight_map)


def describe_target(target_dir) -> dict:
    """Architecture, sizes and where the embedding and head live, from config and headers only."""
    target_dir = _require_directory(target_dir)
    config = read_target_config(target_dir)
    checkpoint = _open_checkpoint(target_dir)
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
        f"sizes         {desc['num_layers']} layers, hidden {desc['hidden_size']}, "
        f"vocab {desc['vocab_size']}",
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
    return (text.get("vocab_size", config.get("vocab_size")),
            text.get("hidden_size", config.get("hidden_size")))


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
        raise SpecdraftError(f"{checkpoint.source}: no input-embedding tensor "
                             f"(looked for {', '.join(EMBED_KEYS)})")
    if lm_head is None and not tied:
        raise SpecdraftError(f"{checkpoint.source}: config.json does not tie word embeddings but no "
                             f"lm_head tensor is stored (looked for {', '.join(LM_HEAD_KEYS)})")
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
        raise SpecdraftError(f"{location.file}: {location.key} has shape {location.shape} but {source} "
                             f"expects (vocab, hidden) = ({wanted})")


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # Same dtype: keep the zero-copy mapping (the draft copies it once, to its own params or GPU).
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ------------------------------------------------------------------------------ checkpoint files


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
    for path in _weight_files(target_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as file:
            for i in range(IDENTITY_BLOCKS):
                file.seek(size * i // IDENTITY_BLOCKS)
                digest.update(file.read(IDENTITY_BLOCK_BYTES))
    return digest.hexdigest()[:16]


def _weight_files(target_dir: Path) -> list[Path]:
    """The files of the first weights layout present (an index and its shards, or one file)."""
    for name in (SAFETENSORS_INDEX, SAFETENSORS_FILE, PYTORCH_INDEX, PYTORCH_FILE):
        path = target_dir / name
        if path.is_file():
            shards = set(_read_index(path).values()) if name.endswith(".index.json") else set()
            return [path, *sorted(shards)]
    raise SpecdraftError(f"{target_dir}: no weight files")


def _open_checkpoint(target_dir: Path):
    """The first weights layout present, in transformers' resolution order."""
    layouts = (
        (SAFETENSORS_INDEX, lambda path: _SafetensorsCheckpoint(path, _read_index(path))),
        (SAFETENSORS_FILE, _SafetensorsCheckpoint.single_file),
        (PYTORCH_INDEX, lambda path: _PytorchCheckpoint(path, _read_index(path))),
        (PYTORCH_FILE, _PytorchCheckpoint.single_file),
    )
    for name, open_layout in layouts:
        path = target_dir / name
        if path.is_file():
            return open_layout(path)
    names = ", ".join(name for name, _ in layouts)
    raise SpecdraftError(f"{target_dir}: no weight files (looked for {names})")


def _read_index(path: Path) -> dict[str, Path]:
    """{tensor key: shard path} from an index's weight_map; every shard it names must exist."""
    index = read_json(path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SpecdraftError(f"{path}: no weight_map")
    if not all(isinstance(name, str) for name in weight_map.values()):
        raise SpecdraftError(f"{path}: weight_map values must be shard file names")
    shards = {name: path.parent / name for name in set(weight_map.values())}
    missing = sorted(name for name, shard in shards.items() if not shard.is_file())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SpecdraftError(f"{path}: names shard {missing[0]}, which does not exist{more}")
    return {key: shards[name] for key, name in weight_map.items()}


class _SafetensorsCheckpoint:
    """Shapes and dtypes come from each shard's JSON header; data is read one tensor at a time."""

    def __init__(self, source: Path, weight_map: dict[str, Path]):
        self.source = source
        self.weight_map = weight_map
        self._headers: dict[Path, dict] = {}

    @classmethod
    def single_file(cls, path: Path) -> _SafetensorsCheckpoint:
        checkpoint = cls(path, {})
        checkpoint.weight_map = {key: path for key in checkpoint._header(path)}
        return checkpoint

    def location(self, key: str) -> TensorLocation:
        path = self.weight_map[key]
        entry = self._header(path).get(key)
        if entry is None:
            raise SpecdraftError(f"{path}: has no tensor {key}, though {self.source.name} says it does")
        return TensorLocation(key, str(path), tuple(entry["shape"]),
                              _SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"].lower()))

    def read(self, location: TensorLocation, dtype: torch.dtype | None) -> torch.Tensor:
        try:
            with safe_open(location.file, framework="pt", device="cpu") as file:
                tensor = file.get_tensor(location.key)
        except SafetensorError as error:
            reason = _first_line(error)
            raise SpecdraftError(f"{location.file}: cannot read {location.key} ({reason})") from error
        return _cast(tensor, dtype)

    def _header(self, path: Path) -> dict:
        if path not in self._headers:
            self._headers[path] = _read_safetensors_header(path)
        return self._headers[path]


def _read_safetensors_header(path: Path) -> dict:
    """{key: {dtype, shape, data_offsets}}, checked against the file's real size.

    safe_open's own errors on a cut-off file do not say which file or how it is cut; these do.
    """
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(_HEADER_LENGTH_BYTES)
        if len(prefix) < _HEADER_LENGTH_BYTES:
            raise SpecdraftError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (header_length,) = struct.unpack("<Q", prefix)
        data_start = _HEADER_LENGTH_BYTES + header_length
        if data_start > size:
            raise SpecdraftError(f"{path}: truncated safetensors header (announces {header_length} bytes, "
                                 f"only {size - _HEADER_LENGTH_BYTES} follow)")
        raw_header = file.read(header_length)
    try:
        header = json.loads(raw_header)
    except ValueError as error:
        raise SpecdraftError(f"{path}: safetensors header is not JSON ({_first_line(error)})") from error
    if not isinstance(header, dict):
        raise SpecdraftError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    _check_header_entries(path, header, size - data_start)
    return header


def _check_header_entries(path: Path, header: dict, data_bytes: int) -> None:
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            well_formed = isinstance(dtype, str) and isinstance(shape, list) and all(
                isinstance(number, int) for number in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            well_formed = False
        if not well_formed:
            raise SpecdraftError(f"{path}: malformed safetensors header entry for {key}")
        if not 0 <= begin <= end <= data_bytes:
            raise SpecdraftError(f"{path}: truncated safetensors data ({key} ends at byte {end}, "
                                 f"only {data_bytes} data bytes present)")


class _PytorchCheckpoint:
    """torch.save'd state dicts, unpickled with weights_only=True so no pickled code ever runs."""

    def __init__(self, source: Path, weight_map: dict[str, Path]):
        self.source = source
        self.weight_map = weight_map
        self._state_dicts: dict[Path, dict[str, torch.Tensor]] = {}

    @classmethod
    def single_file(cls, path: Path) -> _PytorchCheckpoint:
        checkpoint = cls(path, {})
        checkpoint.weight_map = {key: path for key in checkpoint._state_dict(path)}
        return checkpoint

    def location(self, key: str) -> TensorLocation:
        path = self.weight_map[key]
        tensor = self._state_dict(path).get(key)
        if tensor is None:
            raise SpecdraftError(f"{path}: has no tensor {key}, though {self.source.name} says it does")
        return TensorLocation(key, str(path), tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def read(self, location: TensorLocation, dtype: torch.dtype | None) -> torch.Tensor:
        return _cast(self._state_dict(Path(location.file))[location.key], dtype)

    def _state_dict(self, path: Path) -> dict[str, torch.Tensor]:
        if path not in self._state_dicts:
            self._state_dicts[path] = _load_pytorch_state_dict(path)
        return self._state_dicts[path]


def _load_pytorch_state_dict(path: Path) -> dict[str, torch.Tensor]:
    # Only zip-format files (torch >= 1.6) can be memory-mapped; older ones are read whole.
    mmap = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as error:
        raise SpecdraftError(f"{path}: refused to unpickle: it holds more than tensors "
                             f"({_unpickler_reason(error)})") from error
    except (RuntimeError, EOFError, OSError) as error:
        raise SpecdraftError(f"{path}: not a readable PyTorch checkpoint ({_first_line(error)})") from error
    if not isinstance(state, dict):
        raise SpecdraftError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise SpecdraftError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor")
    return state


def _unpickler_reason(error: pickle.UnpicklingError) -> str:
    """The one useful sentence (e.g. 'Unsupported global: GLOBAL io.open ...') of torch's long message."""
    _, found, detail = str(error).partition("WeightsUnpickler error:")
    reason = next((line.strip() for line in detail.splitlines() if line.strip()), "") if found else ""
    return reason.split(". ")[0] if reason else _first_line(error)
