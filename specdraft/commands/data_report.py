"""`specdraft data CONFIG`: what training will learn from, before spending GPU hours.

Tokenises exactly as `train` does (the same packed cache, built by the same code, or reused when
train built it) and reports rows, skipped rows by reason, tokens, trained tokens, the windows of its packing
and truncated rows; `--show N` prints conversations with the trained tokens highlighted, `--json`
one object per row. Loads the target's tokenizer only: no weights, no DeepSpeed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator, List, TextIO, Tuple

import numpy as np

from specdraft.config import resolve_data_files
from specdraft.data.packing import (
    ROWS_FILE,
    TOKEN_DTYPE,
    build_packed_cache,
    packed_cache_dir,
    skipped_summary,
    training_refusal,
)

HIGHLIGHT = ("\x1b[1;32m", "\x1b[0m")  # a terminal: trained text in bold green
MARKERS = ("[[", "]]")  # otherwise


def data_report(
    cfg, show: int = 0, as_json: bool = False, out: TextIO = sys.stdout, log=lambda line: print(line, file=sys.stderr)
) -> str:
    """Writes the report; -> why training would refuse this data ('' when it would train)."""
    from transformers import AutoTokenizer

    files = resolve_data_files(cfg.data_files)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    cache_dir = packed_cache_dir(files, cfg.target, cfg.max_seq_length, cfg.thinking, cfg.data_cache_dir)
    meta = build_packed_cache(
        files,
        tokenizer,
        cfg.max_seq_length,
        cache_dir,
        log,
        thinking=cfg.thinking,
        strict=cfg.data_strict,
        for_training=False,
    )  # a sample too small to train on is shown
    refusal = training_refusal(meta) or ""
    if as_json:
        for row in iter_rows(cache_dir):
            out.write(json.dumps(row_json(tokenizer, row)) + "\n")
        return refusal
    whole, whole_windows = None, cfg.packing == "whole" or cfg.feature_cache is not None  # a cache is whole
    if whole_windows and meta["conversations"]:
        from specdraft.data.whole_packing import WholePackedData

        whole = WholePackedData(cache_dir, meta)
    for line in summary(meta, cache_dir, packing_line(meta, whole, whole_windows), refusal):
        out.write(line + "\n")
    if cfg.feature_cache is not None:
        for line in feature_cache_lines(cfg.feature_cache, whole):
            out.write(line + "\n")
    marks = HIGHLIGHT if out.isatty() else MARKERS
    for row in [r for r in iter_rows(cache_dir) if "skipped" not in r][:show]:
        out.write(f"\n== {row['source']}: {len(row['ids'])} tokens, {int(row['mask'].sum())} trained\n")
        out.write(highlighted(tokenizer, row["ids"], row["mask"], marks) + "\n")
    return refusal


def feature_cache_lines(cache_dir, whole) -> List[str]:
    """What a feature cache holds (its manifest and committed shards, no shard read in full), and
    how many of the data's conversations it serves."""
    from specdraft.features.cache import FeatureCache
    from specdraft.features.manifest import Manifest
    from specdraft.features.rows import row_keys

    manifest = Manifest.read(cache_dir)
    cache = FeatureCache(cache_dir, manifest, list(manifest.kinds))
    shards, rows, tokens, size = cache.totals()
    keys = row_keys(whole)
    missing = cache.missing(keys, [int(min(n, whole.window)) for n in whole.lengths])
    lines = [
        f"feature cache: {cache_dir}: {rows} conversations, {tokens} tokens in {shards} shards, "
        f"{size / 2**20:.1f} MiB ({size / max(tokens, 1):,.0f} bytes per token), {manifest.dtype}"
        + (f" (scales per {manifest.fp8_scale})" if manifest.fp8_scale else "")
        + f", captured up to {manifest.capture_length} tokens",
        f"  fingerprints: {', '.join(f'{k} {v}' for k, v in manifest.fingerprints.items())}",
    ]
    lines += [f"  {kind}: {meaning}" for kind, meaning in manifest.kinds.items()]
    lines.append(f"  this data: {len(keys) - len(missing)} of {len(keys)} conversations cached")
    return lines


def packing_line(meta: dict, whole, whole_windows: bool) -> str:
    """The windows training reads, and the tokens the packing loses to truncation and padding."""
    if whole is not None:
        return whole.describe()
    if whole_windows:
        return "packing whole: no windows (no conversation to train on)"
    return f"packing stream: {meta['sequences']} windows of {meta['max_seq_length']} tokens"


def summary(meta: dict, cache_dir: Path, packing: str, refusal: str) -> List[str]:
    skipped = meta["skipped"]
    rows = meta["conversations"] + sum(e["count"] for e in skipped.values())
    trained = meta["assistant_tokens"]
    lines = [
        f"cache: {cache_dir}",
        f"rows: {rows}",
        f"skipped rows: {rows - meta['conversations']}"
        + "".join(
            f"\n  {reason}: {e['count']} ({', '.join(e['rows'][:3])}{', …' if e['count'] > 3 else ''})"
            for reason, e in skipped.items()
        ),
        f"tokens: {meta['tokens']}",
        f"trained tokens: {trained} ({100 * trained / max(meta['tokens'], 1):.1f}%)",
        packing,
        f"truncated rows: {meta['truncated']} (longer than max_seq_length={meta['max_seq_length']})",
    ]
    if refusal:
        lines.append(f"training would refuse this data: {refusal}")
    if skipped:
        lines.append(skipped_summary(meta))
    return lines


def iter_rows(cache_dir: Path) -> Iterator[dict]:
    """Every row of the cache in order: source, its ids and mask, or the reason it was skipped."""
    cache_dir = Path(cache_dir)
    tokens, mask = _stream(cache_dir / "tokens.bin", TOKEN_DTYPE), _stream(cache_dir / "loss_mask.bin", np.uint8)
    at = 0
    with open(cache_dir / ROWS_FILE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if "skipped" not in row:
                n = row.pop("tokens")
                row["ids"], row["mask"] = tokens[at : at + n], mask[at : at + n]
                at += n
            yield row


def _stream(path: Path, dtype) -> np.ndarray:
    """The whole stream of a cache file, its tail window included (an empty file: no rows kept)."""
    return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)


def row_json(tokenizer, row: dict) -> dict:
    if "skipped" in row:
        return {"source": row["source"], "skipped": row["skipped"], "tokens": 0, "trained": 0, "trained_text": []}
    return {
        "source": row["source"],
        "tokens": len(row["ids"]),
        "trained": int(row["mask"].sum()),
        "trained_text": [tokenizer.decode(ids) for trained, ids in runs(row["ids"], row["mask"]) if trained],
    }


def runs(ids, mask) -> List[Tuple[bool, List[int]]]:
    """Contiguous (trained?, ids) pieces of a row."""
    pieces: List[Tuple[bool, List[int]]] = []
    for token, m in zip(ids, mask):
        if pieces and pieces[-1][0] == bool(m):
            pieces[-1][1].append(int(token))
        else:
            pieces.append((bool(m), [int(token)]))
    return pieces


def highlighted(tokenizer, ids, mask, marks: Tuple[str, str]) -> str:
    return "".join(
        f"{marks[0]}{tokenizer.decode(p)}{marks[1]}" if trained else tokenizer.decode(p)
        for trained, p in runs(ids, mask)
    )
