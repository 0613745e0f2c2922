"""A target's weight files as transformers lays them out (one safetensors file, an index and its
shards, or PyTorch's pickles): which files, where each tensor lives (from headers only), and reading
one tensor. A pickle is loaded weights-only: no code of the file's runs."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdraft.errors import SpecdraftError
from specdraft.target.config_file import read_json


SAFETENSORS_INDEX = "model.safetensors.index.json"


SAFETENSORS_FILE = "model.safetensors"


PYTORCH_INDEX = "pytorch_model.bin.index.json"


PYTORCH_FILE = "pytorch_model.bin"


# safetensors header dtype -> torch dtype name, so both formats describe tensors alike.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


_HEADER_LENGTH_BYTES = 8  # u64 little-endian length of the JSON header


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor lives in a checkpoint, known without reading its data."""

    key: str
    file: str
    shape: tuple[int, ...]
    dtype: str  # torch name as stored, e.g. "bfloat16"


def weight_files(target_dir: Path) -> list[Path]:
    """The files of the first weights layout present (an index and its shards, or one file)."""
    for name in (SAFETENSORS_INDEX, SAFETENSORS_FILE, PYTORCH_INDEX, PYTORCH_FILE):
        path = target_dir / name
        if path.is_file():
            shards = set(read_index(path).values()) if name.endswith(".index.json") else set()
            return [path, *sorted(shards)]
    raise SpecdraftError(f"{target_dir}: no weight files")


def open_checkpoint(target_dir: Path):
    """The first weights layout present, in transformers' resolution order."""
    layouts = (
        (SAFETENSORS_INDEX, lambda path: SafetensorsCheckpoint(path, read_index(path))),
        (SAFETENSORS_FILE, SafetensorsCheckpoint.single_file),
        (PYTORCH_INDEX, lambda path: PytorchCheckpoint(path, read_index(path))),
        (PYTORCH_FILE, PytorchCheckpoint.single_file),
    )
    for name, open_layout in layouts:
        path = target_dir / name
        if path.is_file():
            return open_layout(path)
    names = ", ".join(name for name, _ in layouts)
    raise SpecdraftError(f"{target_dir}: no weight files (looked for {names})")


def read_index(path: Path) -> dict[str, Path]:
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


class SafetensorsCheckpoint:
    """Shapes and dtypes come from each shard's JSON header; data is read one tensor at a time."""

    def __init__(self, source: Path, weight_map: dict[str, Path]):
        self.source = source
        self.weight_map = weight_map
        self._headers: dict[Path, dict] = {}

    @classmethod
    def single_file(cls, path: Path) -> SafetensorsCheckpoint:
        checkpoint = cls(path, {})
        checkpoint.weight_map = {key: path for key in checkpoint._header(path)}
        return checkpoint

    def location(self, key: str) -> TensorLocation:
        path = self.weight_map[key]
        entry = self._header(path).get(key)
        if entry is None:
            raise SpecdraftError(f"{path}: has no tensor {key}, though {self.source.name} says it does")
        return TensorLocation(
            key, str(path), tuple(entry["shape"]), _SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"].lower())
        )

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
            self._headers[path] = read_safetensors_header(path)
        return self._headers[path]


def read_safetensors_header(path: Path) -> dict:
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
            raise SpecdraftError(
                f"{path}: truncated safetensors header (announces {header_length} bytes, "
                f"only {size - _HEADER_LENGTH_BYTES} follow)"
            )
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
            well_formed = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(isinstance(number, int) for number in (*shape, begin, end))
            )
        except (KeyError, TypeError, ValueError):
            well_formed = False
        if not well_formed:
            raise SpecdraftError(f"{path}: malformed safetensors header entry for {key}")
        if not 0 <= begin <= end <= data_bytes:
            raise SpecdraftError(
                f"{path}: truncated safetensors data ({key} ends at byte {end}, only {data_bytes} data bytes present)"
            )


class PytorchCheckpoint:
    """torch.save'd state dicts, unpickled with weights_only=True so no pickled code ever runs."""

    def __init__(self, source: Path, weight_map: dict[str, Path]):
        self.source = source
        self.weight_map = weight_map
        self._state_dicts: dict[Path, dict[str, torch.Tensor]] = {}

    @classmethod
    def single_file(cls, path: Path) -> PytorchCheckpoint:
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
        raise SpecdraftError(
            f"{path}: refused to unpickle: it holds more than tensors ({_unpickler_reason(error)})"
        ) from error
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


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # Same dtype: keep the zero-copy mapping (the draft copies it once, to its own params or GPU).
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
