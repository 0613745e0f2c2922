"""Tokenise conversations once into a packed, memory-mapped cache shared by every rank.

One builder (rank 0) streams the files, tokenises with the target's chat template and appends
token ids, loss masks and document starts (1 at each conversation's first token) to flat binary
files; sequences are the stream cut into max_seq_length windows (the tail shorter than one window
is dropped). A batch carries, besides tokens and loss mask, each token's document id and its
position inside its document (a window's first token starts a document), so the target and the
draft can attend within documents only. Every rank then memory-maps the result, so
no rank ever holds a data file in RAM. The cache directory name is a hash of the inputs; it is
built in a temp directory and renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import torch

from specdraft.rundir.atomic import publish_dir
from specdraft.data.chat import tokenize_conversation, tokenize_text
from specdraft.data.sources import SkippedRow, iter_records, normalise_conversation, plain_text
from specdraft.errors import SpecdraftError
from specdraft.paths import specdraft_home

CACHE_FORMAT = 5  # 2: doc_start.bin; 3: masks from one render, answer + end-of-turn, token_ids honoured;
# 4: spans located by marker renders, rows with nothing to learn skipped (rows.jsonl names each row);
# 5: rows with a tool turn or null content skipped (a format-4 cache trained an answer's text beside its tool_calls)
TOKEN_DTYPE = np.uint32
FLUSH_TOKENS = 1 << 20  # write to disk every ~1M tokens: bounded builder memory
ROWS_FILE = "rows.jsonl"  # per row: its source and token count, or the reason it was skipped
SKIPPED_NAMED = 100  # rows named per skip reason in meta.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class PackedData:
    tokens: np.ndarray  # (N, L) uint32 memmap
    loss_mask: np.ndarray  # (N, L) uint8 memmap: 1 = assistant token (a label)
    doc_start: np.ndarray  # (N, L) uint8 memmap: 1 = first token of a conversation
    meta: dict

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def batch(self, indices) -> dict:
        rows = np.asarray(indices)
        ids = torch.from_numpy(self.tokens[rows].astype(np.int64))
        mask = torch.from_numpy(self.loss_mask[rows].astype(np.int64))
        starts = self.doc_start[rows].astype(bool)
        starts[:, 0] = True  # a window cut mid-conversation starts a document of its own
        index = np.arange(starts.shape[1])
        start_index = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        return {
            "input_ids": ids,
            "loss_mask": mask,
            "document_positions": torch.from_numpy(index - start_index),  # (B, L) position in its document
            "document_ids": torch.from_numpy(np.cumsum(starts, axis=1) - 1),
        }  # (B, L) 0, 1, ... per row


def cache_key(files: List[str], tokenizer_dir: str, max_seq_length: int, thinking=None) -> str:
    digest = hashlib.sha256(f"format={CACHE_FORMAT};L={max_seq_length}".encode())
    if thinking is not None:  # (absent otherwise: existing caches keep their key)
        digest.update(f";thinking={thinking}".encode())
    for path in files:
        stat = os.stat(path)
        digest.update(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    for name in TOKENIZER_FILES:
        candidate = Path(tokenizer_dir) / name
        if candidate.is_file():
            digest.update(candidate.read_bytes())
    return digest.hexdigest()[:20]


def packed_cache_dir(
    files: List[str], tokenizer_dir: str, max_seq_length: int, thinking=None, data_cache_dir=None
) -> Path:
    """Where train (and `specdraft data`) keep the packed tokens of these inputs."""
    root = Path(data_cache_dir) if data_cache_dir else specdraft_home() / "data"
    return root / cache_key(files, tokenizer_dir, max_seq_length, thinking)


def build_packed_cache(
    files: List[str],
    tokenizer,
    max_seq_length: int,
    out_dir: Path,
    log: Callable[[str], None] = print,
    thinking=None,
    strict: bool = False,
    for_training: bool = True,
) -> dict:
    """Stream every conversation into out_dir (created atomically) unless it exists; -> its meta.

    A row with nothing to learn is skipped and counted by reason (strict: refused, naming it).
    for_training: data training cannot use (training_refusal) is refused; `specdraft data`, which
    shows what the files hold, builds and reports it all the same."""
    out_dir = Path(out_dir)
    if (out_dir / "meta.json").is_file():
        meta = json.loads((out_dir / "meta.json").read_text())
        if strict and meta.get("skipped"):  # the cache was built leniently: refuse as a strict build would
            raise SpecdraftError(next(iter(meta["skipped"].values()))["first"])
        _refuse_untrainable(meta, for_training)
        for line in summary_lines(meta):
            log(line)
        return meta
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        stats = _stream_tokens(files, tokenizer, tmp, max_seq_length, thinking, strict)
        meta = dict(
            stats,
            sequences=stats["tokens"] // max_seq_length,
            max_seq_length=max_seq_length,
            files=files,
            format=CACHE_FORMAT,
        )
        _refuse_untrainable(meta, for_training)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        publish_dir(tmp, out_dir)
        for line in summary_lines(meta):
            log(line)
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def training_refusal(meta: dict) -> Optional[str]:
    """Why training cannot use this packed data (None: it can)."""
    if meta["sequences"] == 0:
        return f"data_files: only {meta['tokens']} tokens in total, fewer than max_seq_length={meta['max_seq_length']}"
    if meta["assistant_tokens"] == 0:
        return "data_files: no assistant tokens found (nothing to learn from)" + (
            f"; {skipped_summary(meta)}" if meta["skipped"] else ""
        )
    return None


def _refuse_untrainable(meta: dict, for_training: bool) -> None:
    if for_training and (why := training_refusal(meta)):
        raise SpecdraftError(why)


def summary_lines(meta: dict) -> List[str]:
    lines = [
        f"data: {meta['conversations']} conversations, {meta['tokens']} tokens "
        f"({meta['assistant_tokens']} assistant) -> {meta['sequences']} sequences of {meta['max_seq_length']}; "
        f"{meta['truncated']} rows longer than max_seq_length (truncated)"
    ]
    if meta["skipped"]:
        lines.append(f"data: {skipped_summary(meta)}")
    return lines


def skipped_summary(meta: dict, named: int = 3) -> str:
    """`skipped 3 of 2000 rows: no assistant turn (a.jsonl:6, …), template refused (b.jsonl:9)`."""
    skipped = meta["skipped"]
    total = sum(entry["count"] for entry in skipped.values())
    parts = []
    for reason, entry in skipped.items():
        names = entry["rows"][:named] + (["…"] if entry["count"] > named else [])
        parts.append(f"{reason} ({', '.join(names)})")
    return f"skipped {total} of {total + meta['conversations']} rows: {', '.join(parts)}"


def _stream_tokens(files, tokenizer, out: Path, max_seq_length: int, thinking=None, strict=False) -> dict:
    stats = {"conversations": 0, "tokens": 0, "assistant_tokens": 0, "truncated": 0, "skipped": {}}
    ids_buf: List[int] = []
    mask_buf: List[int] = []
    start_buf: List[int] = []
    with (
        open(out / "tokens.bin", "wb") as ids_file,
        open(out / "loss_mask.bin", "wb") as mask_file,
        open(out / "doc_start.bin", "wb") as start_file,
        open(out / ROWS_FILE, "w", encoding="utf-8") as rows,
    ):

        def flush():
            np.asarray(ids_buf, dtype=TOKEN_DTYPE).tofile(ids_file)
            np.asarray(mask_buf, dtype=np.uint8).tofile(mask_file)
            np.asarray(start_buf, dtype=np.uint8).tofile(start_file)
            ids_buf.clear()
            mask_buf.clear()
            start_buf.clear()

        for where, record in iter_records(files):
            try:
                text = plain_text(record, where)
                if text is not None:
                    ids, mask = tokenize_text(tokenizer, text)
                else:
                    ids, mask = tokenize_conversation(tokenizer, normalise_conversation(record, where), where, thinking)
            except SkippedRow as skip:
                if strict:
                    raise
                entry = stats["skipped"].setdefault(skip.reason, {"count": 0, "rows": [], "first": str(skip)})
                entry["count"] += 1
                if len(entry["rows"]) < SKIPPED_NAMED:
                    entry["rows"].append(where)
                rows.write(json.dumps({"source": where, "skipped": skip.reason}) + "\n")
                continue
            ids_buf.extend(ids)
            mask_buf.extend(mask)
            start_buf.extend([1] + [0] * (len(ids) - 1))
            rows.write(json.dumps({"source": where, "tokens": len(ids)}) + "\n")
            stats["conversations"] += 1
            stats["tokens"] += len(ids)
            stats["assistant_tokens"] += sum(mask)
            stats["truncated"] += len(ids) > max_seq_length
            if len(ids_buf) >= FLUSH_TOKENS:
                flush()
        flush()
    return stats


def open_packed_cache(cache_dir: Path) -> PackedData:
    cache_dir = Path(cache_dir)
    meta = json.loads((cache_dir / "meta.json").read_text())
    shape = (meta["sequences"], meta["max_seq_length"])
    count = shape[0] * shape[1]  # the files may hold a partial tail window: map only whole ones
    tokens = np.memmap(cache_dir / "tokens.bin", dtype=TOKEN_DTYPE, mode="r", shape=(count,)).reshape(shape)
    mask = np.memmap(cache_dir / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(count,)).reshape(shape)
    starts = np.memmap(cache_dir / "doc_start.bin", dtype=np.uint8, mode="r", shape=(count,)).reshape(shape)
    return PackedData(tokens=tokens, loss_mask=mask, doc_start=starts, meta=meta)
