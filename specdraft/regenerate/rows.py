"""regenerate's rows: which rows a rank owns and which are done (keyed by source file, row id and
sample), and each row in the making turn by turn (writer.py writes the complete ones)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from specdraft.data.sources import iter_records, normalise_conversation
from specdraft.errors import SpecdraftError


def row_key(record, messages) -> str:
    """The row's own id when it has one, else a hash of its content (stable across runs)."""
    if isinstance(record, dict) and record.get("id") not in (None, ""):
        return str(record["id"])
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def row_seed(seed: int, key: str, sample: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{sample}|{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def row_owner(row: str, sample: int, world: int) -> int:
    """The rank that writes (row id, sample)."""
    return int(hashlib.sha256(f"{row}#{sample}".encode()).hexdigest(), 16) % world


@dataclass
class Item:
    """One output row in the making: the source's turns are consumed left to right."""

    file: str  # the source file (absolute): rows are keyed by (file, id, sample)
    key: str  # the row's id
    sample: int
    where: str
    source: list
    done: list = field(default_factory=list)  # output messages so far
    next: int = 0  # index into source
    turn: int = 0
    error: Optional[str] = None
    failed: bool = False  # the error is the server's (a rerun asks again), else the row's own
    truncated: int = 0  # answers cut at their token budget

    def advance(self) -> Optional[list]:
        """Copy source turns up to the next answer to write; the prompt for it, or None when complete."""
        while self.next < len(self.source) and self.source[self.next]["role"] != "assistant":
            self.done.append({"role": self.source[self.next]["role"], "content": self.source[self.next]["content"]})
            self.next += 1
        if self.next < len(self.source) or (self.done and self.done[-1]["role"] != "assistant"):
            return list(self.done)
        return None

    def answers(self) -> int:
        """The answers this row asks for: one per assistant turn of its source, one more after a
        last user turn (advance's rule)."""
        ask_last = bool(self.source) and self.source[-1]["role"] != "assistant"
        return sum(m["role"] == "assistant" for m in self.source) + ask_last

    def answer(self, text: str, token_ids, finish: str = "stop") -> None:
        message = {"role": "assistant", "content": text}
        if token_ids is not None:
            message["token_ids"] = token_ids
        if finish == "length":  # cut at its budget: training must not learn an end-of-turn after it
            message["truncated"] = True
            self.truncated += 1
        self.done.append(message)
        self.next += 1  # past the source's assistant turn (or the end, for a trailing prompt)
        self.turn += 1

    def row(self) -> dict:
        return {
            "id": self.key,
            "sample": self.sample,
            "file": self.file,
            "source": self.where,
            "conversations": self.done,
        }

    def error_row(self) -> dict:
        return {
            "id": self.key,
            "sample": self.sample,
            "source": self.where,
            "kind": "failed" if self.failed else "skipped",
            "reason": self.error,
        }


def read_rows(files: List[str], samples: int, rank: int, world: int, done) -> Tuple[List[Item], List[dict], int]:
    """(items to generate, error rows, rows owned) of this rank: rows keyed by (file, id); a row whose
    shape is wrong, or a second row with an id (or content) already seen in its file, is an error row."""
    items, errors, total = [], [], 0
    for file in files:
        path, first = os.path.abspath(file), {}
        for where, record in iter_records([file]):
            try:
                messages = normalise_conversation(record, where, require_answer=False)
            except SpecdraftError as err:
                errors.append(
                    {
                        "id": None,
                        "sample": None,
                        "source": where,
                        "kind": "skipped",
                        "reason": str(err)[len(where) + 2 :] if str(err).startswith(where) else str(err),
                    }
                )
                continue
            key = row_key(record, messages)
            if key in first:
                if row_owner(key, 0, world) == rank:
                    what = f"duplicate id {key!r}" if record.get("id") not in (None, "") else "duplicate row"
                    errors.append(
                        {
                            "id": key,
                            "sample": None,
                            "source": where,
                            "kind": "skipped",
                            "reason": f"{what}: {first[key]} has it (the first is kept)",
                        }
                    )
                continue
            first[key] = where
            for sample in range(samples):
                if row_owner(key, sample, world) != rank:
                    continue
                total += 1
                if (path, key, sample) not in done:
                    items.append(Item(path, key, sample, where, messages))
    return items, errors, total
