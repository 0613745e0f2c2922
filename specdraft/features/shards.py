"""One shard of a feature cache: whole conversations' features in one safetensors file.

    row_keys     (R, 16) uint8   each row's content key (rows.row_key: its token ids and labels)
    row_offsets  (R + 1,) int64  row r is tokens row_offsets[r]:row_offsets[r + 1]
    token_ids    (N,) int32      the tokens the features were computed from (checked on read)
    <kind>       (N, ...)        hidden.<id>, final_hidden (N, H); last_keys / last_values (N, KV, D)
    fp8 only:    scales (N, 1) float32 per token across every kind (token), or <kind>.scale (N, 1)
                 per token and kind (token_layer); stored = value / scale in float8_e4m3fn

Written once (temp file, fsync, rename) with its sha256 computed from the bytes written; read only
after that sha256, the token ids and the values' finiteness are checked (ShardReader.verify).
"""

from __future__ import annotations

import errno
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save

from specdraft.errors import SpecdraftError
from specdraft.features.manifest import SHARDS, ShardEntry
from specdraft.rundir.atomic import write_atomic

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_SCALES = "scales"
READ_BLOCK = 1 << 24  # bytes hashed per read


def bytes_per_token(kind_widths: Dict[str, int], dtype: str, fp8_scale: str) -> int:
    """What one token costs on disk: every kind's elements at the storage width, its token id
    (int32) and, for fp8, its scale(s) (float32)."""
    elements = sum(kind_widths.values())
    size = elements * torch.empty((), dtype=STORAGE_DTYPES[dtype]).element_size() + 4
    if dtype == "fp8":
        size += 4 * (1 if fp8_scale == "token" else len(kind_widths))
    return size


@dataclass
class CapturedRow:
    key: bytes  # 16 bytes: rows.row_key
    token_ids: np.ndarray  # (n,) the tokens captured (a conversation's first capture_length)
    features: Dict[str, torch.Tensor]  # kind -> (n, ...) in the target's dtype, on the host


@dataclass
class ShardBuilder:
    """Rows gathered until a shard's worth of tokens, then encoded."""

    dtype: str
    fp8_scale: str
    rows: List[CapturedRow] = field(default_factory=list)
    tokens: int = 0

    def add(self, row: CapturedRow) -> None:
        self.rows.append(row)
        self.tokens += len(row.token_ids)

    def encode(self) -> bytes:
        kinds = list(self.rows[0].features)
        tensors = {
            "row_keys": torch.from_numpy(np.frombuffer(b"".join(r.key for r in self.rows), dtype=np.uint8).copy()).view(
                len(self.rows), 16
            ),
            "row_offsets": torch.tensor(np.cumsum([0] + [len(r.token_ids) for r in self.rows]), dtype=torch.int64),
            "token_ids": torch.from_numpy(np.concatenate([r.token_ids for r in self.rows]).astype(np.int32)),
        }
        values = {kind: torch.cat([r.features[kind] for r in self.rows]) for kind in kinds}
        tensors.update(encode_values(values, self.dtype, self.fp8_scale))
        return save(tensors)


def encode_values(values: Dict[str, torch.Tensor], dtype: str, fp8_scale: str) -> Dict[str, torch.Tensor]:
    """kind -> (N, ...) values in the storage dtype (fp8: with their float32 scales)."""
    if dtype != "fp8":
        return {kind: value.to(STORAGE_DTYPES[dtype]).contiguous() for kind, value in values.items()}
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    out = {}
    if fp8_scale == "token":  # speculators' layout: one scale per token across every stored kind
        flat = torch.cat([value.reshape(value.shape[0], -1) for value in values.values()], dim=1)
        quantized, scale = quantize_tensor_to_fp8(flat)  # (N, total), (N, 1)
        start = 0
        for kind, value in values.items():
            width = value[0].numel()
            out[kind] = quantized[:, start : start + width].reshape(value.shape).contiguous()
            start += width
        out[FP8_SCALES] = scale.contiguous()
    else:
        for kind, value in values.items():
            quantized, scale = quantize_tensor_to_fp8(value.reshape(value.shape[0], -1))
            out[kind] = quantized.reshape(value.shape).contiguous()
            out[f"{kind}.scale"] = scale.contiguous()
    return out


def decode_value(tensors: Dict[str, torch.Tensor], kind: str, start: int, end: int, dtype) -> torch.Tensor:
    """Tokens start:end of `kind` in `dtype` (fp8 dequantised with its scale)."""
    value = tensors[kind][start:end]
    if value.dtype != torch.float8_e4m3fn:
        return value.to(dtype)
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    scale = tensors[FP8_SCALES if FP8_SCALES in tensors else f"{kind}.scale"][start:end]
    flat = dequantize_fp8_tensor(value.reshape(end - start, -1), scale, dtype=torch.float32)
    return flat.reshape(value.shape).to(dtype)


def shard_name(rank: int, number: int) -> str:
    return f"{SHARDS}/r{rank}-{number:06d}.safetensors"


def write_shard(cache_dir: Path, name: str, payload: bytes, rows: int, tokens: int) -> ShardEntry:
    """The shard's bytes at cache_dir/name, whole or not at all. A full disk is one line naming the
    cache; the shards committed before it stay."""
    path = Path(cache_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(path, payload)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SpecdraftError(
                f"{cache_dir}: the disk is full ({len(payload):,} bytes for {name} did not fit); the shards "
                f"committed before it are kept: free space and run the same command again to go on"
            ) from None
        raise
    return ShardEntry(
        file=name, rows=rows, tokens=tokens, bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest()
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


class ShardReader:
    """A committed shard, checked before its tensors are used. Its bytes are checked against the
    size and sha256 its commit recorded (a truncated, corrupted or swapped-in file is refused) the
    first time a process opens it: one read of the file, at the speed of sha256 (bench/offline.py
    measures it). It is then memory-mapped: a row reads only its own tokens, and each row's values
    are checked finite as they are read."""

    def __init__(self, cache_dir: Path, entry: ShardEntry, kinds: List[str], verified: bool = False):
        from safetensors import safe_open

        self.path = Path(cache_dir) / entry.file
        self.entry = entry
        if not self.path.is_file():
            raise SpecdraftError(f"{self.path}: missing: the cache's manifest lists it")
        if not verified and (self.path.stat().st_size != entry.bytes or file_sha256(self.path) != entry.sha256):
            raise SpecdraftError(
                f"{self.path}: its bytes are not the ones committed (sha256 or size differs: corrupted, "
                f"truncated or another cache's shard); nothing was trained on it"
            )
        try:
            self.file = safe_open(str(self.path), "pt")
            names = set(self.file.keys())
        except (OSError, SafetensorError, ValueError) as err:
            raise SpecdraftError(f"{self.path}: not a feature cache shard ({err})") from None
        missing = [k for k in ("row_keys", "row_offsets", "token_ids", *kinds) if k not in names]
        if missing:
            raise SpecdraftError(f"{self.path}: no tensor {missing[0]!r} (the manifest says it stores it)")
        self.names = names
        self.offsets = self.file.get_tensor("row_offsets").tolist()
        self.token_ids = self.file.get_tensor("token_ids")

    def row_tokens(self, index: int) -> np.ndarray:
        return self.token_ids[self.offsets[index] : self.offsets[index + 1]].numpy()

    def row_features(self, index: int, length: int, kinds: List[str], dtype) -> Dict[str, torch.Tensor]:
        start, end = self.offsets[index], self.offsets[index] + length
        out = {}
        for kind in kinds:
            stored = {kind: self.file.get_slice(kind)[start:end]}
            for scale in (FP8_SCALES, f"{kind}.scale"):
                if scale in self.names:
                    stored[scale] = self.file.get_slice(scale)[start:end]
            value = decode_value(stored, kind, 0, end - start, dtype)
            if not bool(torch.isfinite(value).all()):  # a host tensor: no device sync
                raise SpecdraftError(
                    f"{self.path}: {kind} of row {index} holds non-finite values; nothing was trained on it"
                )
            out[kind] = value
        return out


def row_keys_of(cache_dir: Path, entry: ShardEntry) -> List[bytes]:
    """The row keys a shard holds, read from its file without checking it (an index; every tensor
    is checked by ShardReader before use)."""
    from safetensors import safe_open

    path = Path(cache_dir) / entry.file
    try:
        with safe_open(str(path), "pt") as file:
            keys = file.get_tensor("row_keys")
    except (OSError, SafetensorError, ValueError) as err:
        raise SpecdraftError(f"{path}: not a readable feature cache shard ({err})") from None
    return [bytes(k) for k in keys.numpy()]
