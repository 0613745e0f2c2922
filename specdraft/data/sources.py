"""Conversations from jsonl and parquet files, streamed one record at a time.

Accepted record shapes (one conversation per line / row):
    {"conversations": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
    {"messages": [...same...]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}   (ShareGPT)
An assistant turn may carry "token_ids" (the ids the target generated, from `specdraft
regenerate`); training then uses those ids for its text. "truncated": true marks an answer cut at
its token budget: it is trained without the end-of-turn the template renders after it. `specdraft regenerate` also reads rows
that hold only prompts: {"prompt": "..."} or a conversation without assistant turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from specdraft.errors import SpecdraftError

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "system": "system"}

Message = Dict[str, Any]  # role, content, and optionally token_ids (assistant turns)


class SkippedRow(SpecdraftError):
    """A row with nothing to learn (no assistant turn, a template that refuses it, empty answers):
    skipped and counted by `reason` when building training data, unless data_strict."""

    def __init__(self, where: str, reason: str, detail: str = ""):
        super().__init__(f"{where}: {detail or reason}")
        self.where = where
        self.reason = reason


def iter_conversations(files: List[str]) -> Iterator[Tuple[str, List[Message]]]:
    """Yield (where, messages) with where = "file:line" (jsonl) or "file: row N" (parquet)."""
    for where, record in iter_records(files):
        yield where, normalise_conversation(record, where)


def iter_records(files: List[str]) -> Iterator[Tuple[str, object]]:
    """(where, raw record) of every row of every file, streamed."""
    for path in files:
        suffix = Path(path).suffix.lower()
        if suffix in (".jsonl", ".json"):
            yield from iter_jsonl_records(path)
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


def _iter_parquet(path: str) -> Iterator[Tuple[str, object]]:
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
            yield where, record


def normalise_conversation(record, where: str, require_answer: bool = True) -> List[Message]:
    """The record's turns as messages; require_answer False also takes prompt-only rows."""
    if not isinstance(record, dict):
        raise SpecdraftError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not require_answer and "prompt" in record and "conversations" not in record and "messages" not in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise SpecdraftError(f"{where}: 'prompt' must be a non-empty string")
        return [{"role": "user", "content": record["prompt"]}]
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
        message = {"role": role, "content": content}
        if "token_ids" in turn and role == "assistant":
            ids = turn["token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise SpecdraftError(f"{where}: turn {i} has 'token_ids' that are not a list of token ids")
            message["token_ids"] = ids
        if turn.get("truncated") is True and role == "assistant":
            message["truncated"] = True  # cut at the token budget: its end-of-turn is not trained
        messages.append(message)
    if require_answer and not any(m["role"] == "assistant" for m in messages):
        raise SkippedRow(where, "no assistant turn", "no assistant turn (nothing to learn from)")
    return messages
