"""`specdraft regenerate`: the target writes the answers of a training set.

    specdraft regenerate --target DIR --data GLOB --out DIR [--backend hf|openai] ...

Every assistant turn of every row is replaced by the target's own answer, conditioned on its own
earlier answers (a row ending in a user turn, or holding only a prompt, gets one appended). The
output directory holds what `specdraft train` reads directly:

    OUT/shard-r<rank>-<run>-<k>.jsonl   rows {"id", "sample", "source", "conversations"}; each
                                        regenerated assistant turn carries its "token_ids"
    OUT/manifest.json                   sources, target identity, sampling, counts
    OUT/errors[-r<rank>].jsonl          rows that failed this run, with the reason (retried next run)

Resume is keyed by row id ("id" field, else a hash of the row's content) and sample index: a row
is written only once it is complete, a shard appears whole (written atomically) or not at all, so
a rerun after any crash writes exactly the rows no shard holds yet, each once.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from specdraft.atomic import write_atomic
from specdraft.config import read_yaml, resolve_data_files
from specdraft.data.generation import Request, Sampling
from specdraft.data.sources import iter_records, normalise_conversation
from specdraft.errors import SpecdraftError
from specdraft.outputs import claim_regenerate_out
from specdraft.target.model import check_tokenizer, load_target_tokenizer

MANIFEST = "manifest.json"
SHARD_GLOB = "shard-*.jsonl"


@dataclass
class RegenerateConfig:
    target: str = "???"
    data: List[str] = field(default_factory=list)  # paths or globs: jsonl / parquet
    out: str = "???"
    backend: str = "hf"  # hf | openai
    temperature: float = 0.0
    top_p: float = 1.0
    samples: int = 1  # answers per row, each with its own seed
    max_new_tokens: int = 512
    max_length: int = 4096
    thinking: Optional[bool] = None
    seed: int = 0
    batch_size: int = 32  # hf: rows per generate call
    servers: List[str] = field(default_factory=list)  # openai: base URLs
    concurrency: int = 8  # openai: requests in flight
    model: Optional[str] = None  # openai: the served model's name
    rows_per_shard: int = 1000  # a shard is written when this many rows are complete (and at the end)

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.max_new_tokens, self.max_length, self.thinking)


def load_regenerate_config(path: Optional[str], values: Dict) -> RegenerateConfig:
    """Config file keys <- command-line values (those given); one-line errors."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = [OmegaConf.structured(RegenerateConfig)]
    if path is not None:
        layers.append(read_yaml(path))
    try:
        layers.append(OmegaConf.create({k: v for k, v in values.items() if v is not None}))
        cfg = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as err:
        raise SpecdraftError(f"{path or 'command line'}: {str(err).splitlines()[0]}") from None
    if cfg.backend not in ("hf", "openai"):
        raise SpecdraftError(f"backend must be hf or openai, got {cfg.backend!r}")
    if cfg.samples < 1 or cfg.batch_size < 1 or cfg.rows_per_shard < 1 or cfg.concurrency < 1:
        raise SpecdraftError("samples, batch_size, rows_per_shard and concurrency must be >= 1")
    cfg.sampling().check()
    return cfg


def row_key(record, messages) -> str:
    """The row's own id when it has one, else a hash of its content (stable across runs)."""
    if isinstance(record, dict) and record.get("id") not in (None, ""):
        return str(record["id"])
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def row_seed(seed: int, key: str, sample: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{sample}|{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass
class Item:
    """One output row in the making: the source's turns are consumed left to right."""
    key: str
    sample: int
    where: str
    source: list
    done: list = field(default_factory=list)  # output messages so far
    next: int = 0  # index into source
    turn: int = 0
    error: Optional[str] = None

    def advance(self) -> Optional[list]:
        """Copy source turns up to the next answer to write; the prompt for it, or None when complete."""
        while self.next < len(self.source) and self.source[self.next]["role"] != "assistant":
            self.done.append({"role": self.source[self.next]["role"], "content": self.source[self.next]["content"]})
            self.next += 1
        if self.next < len(self.source) or (self.done and self.done[-1]["role"] != "assistant"):
            return list(self.done)
        return None

    def answer(self, text: str, token_ids) -> None:
        message = {"role": "assistant", "content": text}
        if token_ids is not None:
            message["token_ids"] = token_ids
        self.done.append(message)
        self.next += 1  # past the source's assistant turn (or the end, for a trailing prompt)
        self.turn += 1

    def row(self) -> dict:
        return {"id": self.key, "sample": self.sample, "source": self.where, "conversations": self.done}


class ShardWriter:
    """Completed rows -> atomically written shards, named per rank and run (never overwritten)."""

    def __init__(self, out: Path, rank: int, rows_per_shard: int):
        self.out, self.rows_per_shard = out, rows_per_shard
        # a run killed mid-write (SIGKILL, power loss) leaves its shard's temp file: never a
        # shard, so this rank's rerun removes it (each rank only its own: they run at once)
        for stale in out.glob(f"shard-r{rank:03d}-*.jsonl.tmp"):
            stale.unlink(missing_ok=True)
        self.prefix = f"shard-r{rank:03d}-{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
        self.pending: List[dict] = []
        self.count = 0

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.rows_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.pending)
        write_atomic(self.out / f"{self.prefix}-{self.count:05d}.jsonl", text)
        self.count += 1
        self.pending.clear()


def written_keys(out: Path) -> Dict[str, int]:
    """(id#sample) -> answer tokens of every row in the committed shards."""
    keys: Dict[str, int] = {}
    for path in sorted(out.glob(SHARD_GLOB)):
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                keys[f"{row['id']}#{row['sample']}"] = sum(len(m.get("token_ids") or ()) for m in row["conversations"])
    return keys


def regenerate(cfg: RegenerateConfig, backend=None, log: Callable[[str], None] = print,
               progress_bar: bool = True) -> dict:
    """Run (or resume) a regeneration; returns the summary. `backend`: an already built one (the
    demo passes its in-process model); default: built from cfg."""
    from specdraft.target.weights import target_identity

    files = resolve_data_files(cfg.data, "command line", "--data")
    check_tokenizer(cfg.target, "--target")
    out = Path(cfg.out)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    claim_regenerate_out(out, rank)  # before the target is loaded
    settings = {"target": target_identity(cfg.target), "sampling": asdict(cfg.sampling()), "seed": cfg.seed,
                "samples": cfg.samples, "sources": [os.path.abspath(f) for f in files]}
    _check_manifest(out, settings)
    done = written_keys(out)
    items, total = [], 0
    for where, record in iter_records(files):
        messages = normalise_conversation(record, where, require_answer=False)
        key = row_key(record, messages)
        for sample in range(cfg.samples):
            name = f"{key}#{sample}"
            owner = int(hashlib.sha256(name.encode()).hexdigest(), 16) % world
            total += owner == rank
            if owner == rank and name not in done:
                done[name] = -1  # a duplicate row later in the input is the same row
                items.append(Item(key, sample, where, messages))
    if backend is None:
        backend = _build_backend(cfg)
    suffix = "" if world == 1 else f"-r{rank:03d}"
    writer = ShardWriter(out, rank, cfg.rows_per_shard)
    errors: List[dict] = []
    stats = {"rows": 0, "tokens": 0}
    t0 = time.perf_counter()
    bar = _progress(len(items), progress_bar)

    def on_tokens(n: int) -> None:
        stats["tokens"] += n
        bar.set_postfix_str(f"{stats['tokens'] / max(time.perf_counter() - t0, 1e-9):.0f} tok/s", refresh=False)

    wave = max(cfg.batch_size, cfg.concurrency) * 4  # rows in flight: whole batches for every turn
    for start in range(0, len(items), wave):
        active = items[start:start + wave]
        while active:
            prompts = [(item, item.advance()) for item in active]
            finished = [item for item, prompt in prompts if prompt is None]
            asking = [(item, prompt) for item, prompt in prompts if prompt is not None]
            answers = backend.generate([Request(p, row_seed(cfg.seed, i.key, i.sample, i.turn), i.where)
                                        for i, p in asking], on_tokens) if asking else []
            for (item, _), answer in zip(asking, answers):
                if answer.error is None and not answer.text.strip():
                    answer.error = "empty answer"
                if answer.error is not None:
                    item.error = f"turn {item.turn}: {answer.error}"
                else:
                    item.answer(answer.text, answer.token_ids)
            for item in finished:
                writer.add(item.row())
                stats["rows"] += 1
                bar.update(1)
            for item in active:
                if item.error is not None:
                    errors.append({"id": item.key, "sample": item.sample, "source": item.where, "reason": item.error})
                    bar.update(1)
            complete = {id(item) for item in finished}
            active = [item for item in active if item.error is None and id(item) not in complete]
    writer.flush()
    bar.close()
    elapsed = time.perf_counter() - t0
    write_atomic(out / f"errors{suffix}.jsonl", "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors))
    written = written_keys(out)
    summary = {"rows": stats["rows"], "tokens": stats["tokens"], "seconds": round(elapsed, 2),
               "tok_per_s": round(stats["tokens"] / elapsed, 1) if elapsed > 0 else 0.0,
               "errors": len(errors), "rows_total": total, "rows_written": len(written),
               "skipped_done": total - len(items)}
    if rank == 0:
        manifest = {**settings, "backend": backend.name, "token_ids": _ids_note(backend),
                    "counts": {"rows_written": len(written), "answer_tokens": sum(max(v, 0) for v in written.values()),
                               "errors_last_run": len(errors)},
                    "shards": sorted(p.name for p in out.glob(SHARD_GLOB))}
        write_atomic(out / MANIFEST, json.dumps(manifest, indent=1))
    log(f"regenerate: {stats['rows']} rows, {stats['tokens']} tokens in {elapsed:.1f}s "
        f"({summary['tok_per_s']:.0f} tok/s), {len(errors)} errors"
        + (f" (see {out / f'errors{suffix}.jsonl'})" if errors else "")
        + f"; {len(written)} rows in {out}")
    return summary


def _check_manifest(out: Path, settings: dict) -> None:
    path = out / MANIFEST
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    changed = [k for k in ("target", "sampling", "seed", "samples") if old.get(k) != settings[k]]
    if changed:
        raise SpecdraftError(f"{out}: holds rows regenerated with other {', '.join(changed)}; "
                             f"use a new --out directory (or delete it)")


def _ids_note(backend) -> str:
    if backend.name == "hf":
        return "generated ids"
    return "server ids" if not getattr(backend, "_no_ids", None) else "none from some servers: text tokenised"


def _build_backend(cfg: RegenerateConfig):
    if cfg.backend == "openai":
        from specdraft.data.openai_backend import OpenAIBackend

        tokenizer = load_target_tokenizer(cfg.target)
        return OpenAIBackend(cfg.servers, tokenizer, cfg.sampling(), concurrency=cfg.concurrency, model=cfg.model)
    from specdraft.data.generation import HFBackend

    local = os.environ.get("LOCAL_RANK")
    device = None
    import torch

    if local is not None and torch.cuda.is_available():
        device = f"cuda:{int(local)}"
    return HFBackend.load(cfg.target, cfg.sampling(), cfg.batch_size, device)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="row", disable=not enabled, dynamic_ncols=True)
