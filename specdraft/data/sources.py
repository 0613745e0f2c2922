"""Conversations from jsonl and parquet files, streamed one record at a time.

Accepted record shapes (one conversation per line / row):
    {"conversations": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
    {"messages": [...same...]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}   (ShareGPT)
    {"text": "..."}                                   (plain text: every token trained, for base models)
An assistant turn may carry "token_ids" (the ids the target generated, from `specdraft
regenerate`); training then uses those ids for its text. "truncated": true marks an answer cut at
its token budget: it is trained without the end-of-turn the template renders after it. `specdraft regenerate` also reads rows
that hold only prompts: {"prompt": "..."} or a conversation without assistant turns.

A row with a tool turn (a tool role, or an assistant turn carrying "tool_calls" / "function_call")
or a turn whose content is null is skipped and counted ("tool turn", "null content"), never
coerced: tool calls are not trained yet, and null read as "" would train text the row never had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from specdraft.errors import SpecdraftError

ROLE_ALIASES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
# tool results and calls: OpenAI ("tool", its older "function"), Llama 3 ("ipython"), ShareGPT
# tool-use sets ("function_call", "observation")
TOOL_ROLES = ("tool", "function", "ipython", "function_call", "observation")
TOOL_CALL_KEYS = ("tool_calls", "function_call")  # an assistant turn that calls a tool (OpenAI)

Message = Dict[str, Any]  # role, content, and optionally token_ids (assistant turns)


class SkippedRow(SpecdraftError):
    """A row with nothing to learn (no assistant turn, a template that refuses it, empty answers)
    or with turns not trained yet (a tool turn, null content): skipped and counted by `reason`
    when building training data, unless data_strict."""

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


def plain_text(record, where: str) -> Optional[str]:
    """A {"text": "..."} row's text (trained whole, no chat template); None for a chat row."""
    if not isinstance(record, dict) or "text" not in record or "conversations" in record or "messages" in record:
        return None
    if not isinstance(record["text"], str) or not record["text"].strip():
        raise SkippedRow(where, "empty text", "'text' is empty")
    return record["text"]


def is_prompt_row(record) -> bool:
    """A {"prompt": "..."} row: a prompt alone, no conversation."""
    return (
        isinstance(record, dict) and "prompt" in record and "conversations" not in record and "messages" not in record
    )


def normalise_conversation(record, where: str, require_answer: bool = True) -> List[Message]:
    """The record's turns as messages; require_answer False also takes prompt-only rows."""
    if not isinstance(record, dict):
        raise SpecdraftError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if not require_answer and is_prompt_row(record):
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise SpecdraftError(f"{where}: 'prompt' must be a non-empty string")
        return [{"role": "user", "content": record["prompt"]}]
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise SpecdraftError(f"{where}: expected a non-empty 'conversations' or 'messages' list")
    messages, skips = [], {}
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SpecdraftError(f"{where}: turn {i} is not an object")
        skip = _skipped_turn(turn, i, where)
        if skip is not None:  # the other turns are still checked: a malformed file is an error, not a skip
            skips.setdefault(skip.reason, skip)
            continue
        messages.append(_message(turn, i, where))
    if skips:  # one reason per row: a tool turn before a null content
        raise skips.get("tool turn") or skips["null content"]
    if require_answer and not any(m["role"] == "assistant" for m in messages):
        raise SkippedRow(where, "no assistant turn", "no assistant turn (nothing to learn from)")
    return messages


def _skipped_turn(turn: dict, i: int, where: str):
    """The SkippedRow a tool turn or a null-content turn makes of its row; None for any other turn."""
    name = turn.get("role", turn.get("from"))
    if name in TOOL_ROLES:
        return SkippedRow(where, "tool turn", f"tool turn: turn {i} has role {name!r} (tool calls are not trained yet)")
    calls = next((key for key in TOOL_CALL_KEYS if turn.get(key)), None)  # [] / null: no call
    if calls is not None:
        return SkippedRow(where, "tool turn", f"tool turn: turn {i} carries {calls!r} (tool calls are not trained yet)")
    key = "content" if "content" in turn else "value"
    if key in turn and turn[key] is None and _role(name) is not None:  # an unknown role stays an error
        return SkippedRow(where, "null content", f"null content: turn {i} ({name}) has {key} null")
    return None


def _message(turn: dict, i: int, where: str) -> Message:
    """One turn as a message: role, text content, and the assistant's token_ids / truncated."""
    name = turn.get("role", turn.get("from"))
    role = _role(name)
    content = turn.get("content", turn.get("value"))
    if role is None:
        raise SpecdraftError(f"{where}: turn {i} has unknown role {name!r}")
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
    return message


def _role(name) -> Optional[str]:
    """The role a turn's role/from names (user, assistant, system); None when unknown."""
    return ROLE_ALIASES.get(name) if isinstance(name, str) else None  # a list there is not a role
