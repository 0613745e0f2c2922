"""Conversations from jsonl and parquet files, streamed one record at a time.

Accepted record shapes (one conversation per line / row):
    {"conversations": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
    {"messages": [...same...]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}   (ShareGPT)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from specdraft.errors import SpecdraftError

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "system": "system"}

Message = Dict[str, str]


def iter_conversations(files: List[str]) -> Iterator[Tuple[str, List[Message]]]:
    """Yield (where, messages) with where = "file:line" (jsonl) or "file: row N" (parquet)."""
    for path in files:
        suffix = Path(path).suffix.lower()
        if suffix in (".jsonl", ".json"):
            yield from _iter_jsonl(path)
        elif suffix == ".parquet":
            yield from _iter_parquet(path)
        else:
            raise SpecdraftError(f"{path}: unsupported data file type '{suffix}' (use .jsonl or .parquet)")


def iter_jsonl_records(path) -> Iterator[Tuple[str, object]]:
    """(where, parsed JSON) per non-blank line, streamed; a bad line names file:line."""
    with open(path, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecdraftError(f"{where}: not valid JSON ({err.msg})") from None
            yield where, record


def _iter_jsonl(path: str) -> Iterator[Tuple[str, List[Message]]]:
    for where, record in iter_jsonl_records(path):
        yield where, normalise_conversation(record, where)


def _iter_parquet(path: str) -> Iterator[Tuple[str, List[Message]]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise SpecdraftError(f"{path}: not a readable parquet file ({err})") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=256):  # a batch at a time, never the whole file
        for record in batch.to_pylist():
            where = f"{path}: row {row}"
            row += 1
            yield where, normalise_conversation(record, where)


def normalise_conversation(record, where: str) -> List[Message]:
    if not isinstance(record, dict):
        raise SpecdraftError(f"{where}: expected a JSON object, got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise SpecdraftError(f"{where}: expected a non-empty 'conversations' or 'messages' list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SpecdraftError(f"{where}: turn {i} is not an object")
        role = ROLE_ALIASES.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None:
            raise SpecdraftError(f"{where}: turn {i} has unknown role {turn.get('role', turn.get('from'))!r}")
        if not isinstance(content, str):
            raise SpecdraftError(f"{where}: turn {i} has no text 'content'")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise SpecdraftError(f"{where}: no assistant turn (nothing to learn from)")
    return messages
