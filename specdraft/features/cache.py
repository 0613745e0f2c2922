"""Reading and filling a feature cache from a run: which rows it holds, each window's features as
one batch, and (capture, hybrid) new shards committed as they fill.

    cache = FeatureCache.open(cfg.feature_cache, expected, log)   # refuses a foreign cache
    batch = cache.window_features(data, keys, windows, dtype)      # None: a row is missing
    writer = CacheWriter(cache_dir, manifest, rank, shard_tokens)  # capture and hybrid
    writer.add(CapturedRow(...)); writer.flush()

A shard is checked the first time a process reads it (shards.ShardReader: sha256, layout) and each
row as it is read (its token ids against the data's, its values finite): nothing trains on a
tensor that was not checked.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.features.manifest import (
    DESCRIPTION,
    MANIFEST,
    WHAT_ROWS_HOLD,
    PARTS,
    SHARDS,
    Manifest,
    ShardEntry,
    commit_to_part,
    committed_shards,
    part_file,
    read_part,
    reject_shard,
)
from specdraft.features.shards import CapturedRow, ShardBuilder, ShardReader, row_keys_of, shard_name, write_shard

OPEN_SHARDS = 32  # verified shards kept open (memory-mapped) per process


@dataclass(frozen=True)
class RowPlace:
    entry: ShardEntry
    index: int  # the row's index in its shard
    length: int  # tokens stored


class FeatureCache:
    def __init__(self, cache_dir: Path, manifest: Manifest, kinds: Sequence[str], recompute=None):
        """recompute (hybrid): a log; a shard that fails a check is then set aside (its rows
        computed again) instead of stopping the run."""
        self.cache_dir = Path(cache_dir)
        self.manifest = manifest
        self.kinds = list(kinds)  # what this run reads (a subset of what the cache stores)
        self.rows: Dict[bytes, List[RowPlace]] = {}  # a row recomputed after a bad shard has two places
        self.bad: set = set()  # shards that failed a check (hybrid)
        self.recompute = recompute
        self._indexed: set = set()
        self._open: "OrderedDict[str, ShardReader]" = OrderedDict()
        self._verified: set = set()
        self.refresh()

    @classmethod
    def open(cls, cache_dir, expected: Manifest, kinds: Sequence[str], recompute=None) -> "FeatureCache":
        """The cache at cache_dir, refused in one line before anything trains when it was captured
        from another target, tokenizer or template, or does not store every tensor `kinds` names."""
        manifest = Manifest.read(cache_dir)
        for name, value in expected.fingerprints.items():
            if manifest.fingerprints.get(name) != value:
                raise SpecdraftError(
                    f"{Path(cache_dir) / MANIFEST}: captured from another {name} "
                    f"({manifest.fingerprints.get(name)}, this run's is {value}); capture this run's features "
                    f"into another feature_cache"
                )
        if manifest.num_layers != expected.num_layers:
            raise SpecdraftError(
                f"{Path(cache_dir) / MANIFEST}: a target of {manifest.num_layers} layers, this run's has "
                f"{expected.num_layers}"
            )
        absent = [kind for kind in kinds if kind not in manifest.kinds]
        if absent:
            raise SpecdraftError(
                f"{Path(cache_dir) / MANIFEST}: no {absent[0]} ({expected.kinds.get(absent[0], absent[0])}); the "
                f"cache stores {', '.join(manifest.kinds)}: capture with this run's drafts"
            )
        return cls(cache_dir, manifest, kinds, recompute)

    def refresh(self) -> None:
        """Index the rows of every shard committed since the last look (other ranks' too)."""
        for entry in committed_shards(self.cache_dir, self.manifest):
            if entry.file in self._indexed:
                continue
            self._indexed.add(entry.file)
            try:
                reader_keys = row_keys_of(self.cache_dir, entry)
                if len(reader_keys) != entry.rows:
                    raise SpecdraftError(
                        f"{self.cache_dir / entry.file}: {len(reader_keys)} rows, committed as {entry.rows}"
                    )
                offsets = _offsets_of(self.cache_dir / entry.file)
                if offsets[0] != 0 or offsets[-1] != entry.tokens or np.any(np.diff(offsets) < 1):
                    raise SpecdraftError(
                        f"{self.cache_dir / entry.file}: its row offsets disagree with its commit ({entry.tokens} "
                        f"tokens): corrupted, or another cache's shard; nothing was trained on it"
                    )
            except SpecdraftError as err:
                self._set_aside(entry, err)
                continue
            for index, key in enumerate(reader_keys):
                self.rows.setdefault(key, []).append(RowPlace(entry, index, offsets[index + 1] - offsets[index]))

    def _set_aside(self, entry: ShardEntry, err: SpecdraftError) -> None:
        """A shard that failed a check: offline, the run stops on it (one line); hybrid, its rows
        count as missing from now on and are computed again."""
        if self.recompute is None:
            raise err
        self.bad.add(entry.file)
        self._open.pop(entry.file, None)
        reject_shard(self.cache_dir, entry, str(err))  # no reader lists it again: its rows are committed anew
        self.recompute(f"features: {err}; its rows are computed again (hybrid)")

    def _place(self, key: bytes, length: int) -> Optional[RowPlace]:
        for place in self.rows.get(key, ()):
            if place.entry.file not in self.bad and place.length >= length:
                return place
        return None

    def totals(self) -> Tuple[int, int, int, int]:
        """(shards, rows, tokens, bytes) committed."""
        return cache_totals(self.cache_dir, self.manifest)

    def missing(self, keys: Sequence[bytes], lengths: Sequence[int]) -> List[int]:
        """Indices of the rows (by key, with the tokens a window keeps of each) the cache cannot serve."""
        return [i for i, (key, n) in enumerate(zip(keys, lengths)) if self._place(key, n) is None]

    def _reader(self, entry: ShardEntry) -> ShardReader:
        reader = self._open.get(entry.file)
        if reader is None:
            reader = ShardReader(self.cache_dir, entry, self.kinds, verified=entry.file in self._verified)
            self._verified.add(entry.file)
            self._open[entry.file] = reader
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        self._open.move_to_end(entry.file)
        return reader

    def window_features(self, data, keys: Sequence[bytes], windows, dtype) -> Optional[Dict[str, torch.Tensor]]:
        """kind -> (B, T, ...) features of the windows (whole-packed data), in dtype; zeros where a
        window is padding. None when a row of them is missing (hybrid computes the batch)."""
        placements = [data.placements(int(w)) for w in np.asarray(windows)]
        flat = [p for places in placements for p in places]
        if self.missing([keys[p.row] for p in flat], [p.length for p in flat]):
            return None
        out: Dict[str, torch.Tensor] = {}
        for b, places in enumerate(placements):
            for place in places:
                where = self._place(keys[place.row], place.length)
                try:
                    values = self._row(data, place, where, dtype)
                except SpecdraftError as err:
                    self._set_aside(where.entry, err)
                    return None
                for kind, value in values.items():
                    if kind not in out:
                        out[kind] = torch.zeros((len(placements), data.window, *value.shape[1:]), dtype=dtype)
                    out[kind][b, place.offset : place.offset + place.length] = value
        return out

    def _row(self, data, place, where: RowPlace, dtype) -> Dict[str, torch.Tensor]:
        """One conversation's features, checked: its shard (first read), its token ids, its values."""
        reader = self._reader(where.entry)
        expected = np.asarray(data.conversation(place.row)[0][: place.length], dtype=np.int64)
        stored = reader.row_tokens(where.index)[: place.length].astype(np.int64)
        if not np.array_equal(stored, expected):
            raise SpecdraftError(
                f"{reader.path}: row {where.index} holds other token ids than the data's conversation "
                f"{place.row}; nothing was trained on it"
            )
        return reader.row_features(where.index, place.length, self.kinds, dtype)


def _offsets_of(path: Path) -> List[int]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return file.get_tensor("row_offsets").tolist()


class CacheWriter:
    """Rows in, shards out: every shard_tokens tokens a shard is written whole (temp file, fsync,
    rename) and committed to this rank's part file, so a kill at any instant loses at most the rows
    not yet in a committed shard, and never leaves one half-written where a reader looks."""

    def __init__(self, cache_dir: Path, manifest: Manifest, rank: int, shard_tokens: int):
        self.cache_dir = Path(cache_dir)
        self.rank = rank
        self.shard_tokens = shard_tokens
        self.builder = ShardBuilder(manifest.dtype, manifest.fp8_scale or "token")
        self.committed: List[ShardEntry] = []
        self.pending: set = set()  # keys of the rows added, not yet in a committed shard
        listed = read_part(part_file(cache_dir, rank)) if part_file(cache_dir, rank).is_file() else []
        self.number = 1 + max((_shard_number(e.file) for e in listed), default=0)

    def add(self, row: CapturedRow) -> None:
        self.builder.add(row)
        self.pending.add(row.key)
        if self.builder.tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> Optional[ShardEntry]:
        if not self.builder.rows:
            return None
        name = shard_name(self.rank, self.number)
        while (self.cache_dir / name).exists():  # a file no part lists (a kill before its commit)
            self.number += 1
            name = shard_name(self.rank, self.number)
        entry = write_shard(self.cache_dir, name, self.builder.encode(), len(self.builder.rows), self.builder.tokens)
        commit_to_part(self.cache_dir, self.rank, entry)
        self.committed.append(entry)
        self.number += 1
        self.builder.rows, self.builder.tokens = [], 0
        self.pending.clear()
        return entry


def _shard_number(name: str) -> int:
    return int(Path(name).stem.split("-")[1])


def remove_uncommitted(cache_dir: Path, manifest: Manifest) -> List[str]:
    """Shard files no commit lists and our temp files (a capture killed between its write and its
    commit): removed, so a rerun writes those rows again exactly once. Rank 0, before any writer."""
    listed = {entry.file for entry in committed_shards(cache_dir, manifest)}
    removed = []
    for directory in (Path(cache_dir) / SHARDS, Path(cache_dir) / PARTS):
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            name = f"{directory.name}/{path.name}"
            stray_shard = directory.name == SHARDS and path.suffix == ".safetensors" and name not in listed
            temp = path.name.startswith(".") and path.name.endswith(".tmp")
            if stray_shard or temp:
                os.unlink(path)
                removed.append(name)
    return removed


def cache_totals(cache_dir: Path, manifest: Manifest) -> Tuple[int, int, int, int]:
    """(shards, rows, tokens, bytes) committed."""
    entries = committed_shards(cache_dir, manifest)
    return len(entries), sum(e.rows for e in entries), sum(e.tokens for e in entries), sum(e.bytes for e in entries)


def prepare_cache_dir(cache_dir: Path, manifest: Manifest, log, hybrid: bool = False) -> None:
    """Rank 0 (capture, hybrid): a new cache (manifest first), or the same capture continued (its manifest must
    describe what this run captures; shards no commit lists are removed)."""
    if (cache_dir / MANIFEST).is_file():
        existing = Manifest.read(cache_dir)
        differs = existing.same_contents(manifest, WHAT_ROWS_HOLD if hybrid else DESCRIPTION)
        if differs:
            raise SpecdraftError(
                f"{cache_dir / MANIFEST}: this cache holds another capture ({differs}); nothing was "
                f"written: choose another feature_cache"
            )
        removed = remove_uncommitted(cache_dir, existing)
        if removed:
            log(f"capture: removed {len(removed)} file(s) no commit lists ({', '.join(removed[:3])})")
        log(f"capture: continuing {cache_dir}: {len(committed_shards(cache_dir, existing))} shards committed")
        return
    if cache_dir.exists() and (not cache_dir.is_dir() or any(cache_dir.iterdir())):
        raise SpecdraftError(
            f"{cache_dir}: exists and is not a feature cache (no {MANIFEST}); nothing in it was touched: "
            f"point feature_cache at a new or empty directory"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest.write(cache_dir)
