"""`specdraft regenerate` end to end: the rows a rank owns through the backend, into shards, and the
manifest (the command, its outputs and its resume: specdraft/regenerate/__init__.py)."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from specdraft.rundir.atomic import write_atomic
from specdraft.config import read_yaml, resolve_data_files
from specdraft.regenerate.backends import Request, Sampling
from specdraft.errors import SpecdraftError
from specdraft.rundir.ownership import claim_regenerate_out
from specdraft.regenerate.rows import Item, read_rows, row_seed
from specdraft.regenerate.writer import SHARD_GLOB, ShardWriter, written_keys
from specdraft.regenerate.ranks import MANIFEST, Interrupted, RankSync, RegenerateInterrupted, Stop
from specdraft.target.checks import check_chat_template
from specdraft.target.model import check_tokenizer, load_target_tokenizer

# Test hook: seconds to sleep after each generate call, so a test can signal a run whose rows land
# wave after wave.
PAUSE_ENV = "SPECDRAFT_REGENERATE_PAUSE_S"


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
    timeout: float = 600.0  # openai: seconds per request

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
    if not cfg.timeout > 0:
        raise SpecdraftError(f"timeout must be > 0 seconds, got {cfg.timeout}")
    cfg.sampling().check()
    return cfg


def regenerate(
    cfg: RegenerateConfig,
    backend=None,
    log: Callable[[str], None] = print,
    progress_bar: bool = True,
    ranks: Optional[Tuple[int, int]] = None,
) -> dict:
    """Run (or resume) a regeneration; returns the summary (its "failed": rows the servers did not
    answer, a non-zero exit for the command). `backend`: an already built one (the demo passes its
    in-process model); default: built from cfg. `ranks`: (rank, world), default RANK / WORLD_SIZE
    (the global rank: a multi-node run has a LOCAL_RANK 0 on every node); (0, 1) for a process
    that writes every row alone whatever launched it. A signal ends it with RegenerateInterrupted."""
    files = resolve_data_files(cfg.data, "command line", "--data")
    check_tokenizer(cfg.target, "--target")
    check_chat_template(cfg.target, "--target")
    out = Path(cfg.out)
    rank, world = ranks or (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    claim_regenerate_out(out, rank)  # before the target is loaded
    settings = run_settings(cfg, files, cfg.backend if backend is None else backend.name)
    _check_manifest(out, settings)  # before any model is loaded or server asked
    items, errors, total = read_rows(files, cfg.samples, rank, world, written_keys(out))
    if backend is None:
        backend = _build_backend(cfg)
    if hasattr(backend, "check"):
        backend.check()  # every server answers, before the first row
    if rank == 0 and not (out / MANIFEST).is_file():  # the settings go on disk before the first shard
        write_atomic(out / MANIFEST, json.dumps(settings, indent=1))
    stop = Stop()
    sync = RankSync(out, rank, world, stop, log)
    writer = ShardWriter(out, rank, cfg.rows_per_shard, ready=sync.manifest_ready)
    stats = {"rows": 0, "tokens": 0, "truncated": 0, "t0": time.perf_counter()}
    with stop.installed():
        bar = _progress(sum(item.answers() for item in items), progress_bar)
        try:
            _generate(cfg, backend, items, writer, errors, stats, bar, stop)
        except Interrupted:
            pass  # stop.signum says which: the rows finished before it are in the writer
        writer.flush()
        bar.close()
        elapsed = time.perf_counter() - stats["t0"]
        errors_file = out / f"errors{'' if world == 1 else f'-r{rank:03d}'}.jsonl"
        if sync.manifest_ready():
            write_atomic(errors_file, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors))
        mine = {"errors": len(errors), "refused": _refused(backend)}
        if rank == 0:  # the counts over every rank, once all have written their rows
            _write_manifest(out, settings, backend.name, [mine, *sync.gather().values()], stop.name)
        else:
            sync.finish(mine)
    written = written_keys(out)
    if stop.signum:
        log(
            f"regenerate: interrupted by {stop.name}: {len(written)} rows on disk in {out} ({stats['rows']} "
            f"written by this run); rerun the same command to resume"
        )
        raise RegenerateInterrupted(stop.signum)
    failed = [e for e in errors if e["kind"] == "failed"]
    skipped = [e for e in errors if e["kind"] == "skipped"]
    summary = {
        "rows": stats["rows"],
        "tokens": stats["tokens"],
        "seconds": round(elapsed, 2),
        "tok_per_s": round(stats["tokens"] / elapsed, 1) if elapsed > 0 else 0.0,
        "truncated": stats["truncated"],
        "errors": len(errors),
        "failed": len(failed),
        "skipped": len(skipped),
        "rows_total": total,
        "rows_written": len(written),
        "skipped_done": total - len(items),
    }
    log(
        f"regenerate: {stats['rows']} rows, {stats['tokens']} tokens in {elapsed:.1f}s "
        f"({summary['tok_per_s']:.0f} tok/s), {stats['truncated']} answers cut at max_new_tokens"
        + (f"; {len(skipped)} rows skipped ({_reasons(skipped)})" if skipped else "")
        + (f"; {len(failed)} rows FAILED (server errors: rerun the same command to retry them)" if failed else "")
        + (f" (see {errors_file})" if errors else "")
        + (f"; {len(written)} rows in {out}" if written else f"; NO rows in {out}")
    )
    return summary


def _generate(
    cfg: RegenerateConfig,
    backend,
    items: List[Item],
    writer: ShardWriter,
    errors: List[dict],
    stats: dict,
    bar,
    stop: Stop,
) -> None:
    """Every item through its turns, in waves of whole batches; complete rows go to the writer. A
    signal ends it out of a generate call (Interrupted): the answers of that call are lost, never
    a row half recorded."""

    def on_tokens(n: int) -> None:  # both backends call it once per answer, as each batch lands
        stats["tokens"] += n
        bar.set_postfix_str(
            f"{stats['tokens'] / max(time.perf_counter() - stats['t0'], 1e-9):.0f} tok/s", refresh=False
        )
        bar.update(1)

    answered = 0  # answers written, plus every answer a failed row will not ask for

    def settle() -> None:  # the bar exact again after a call (an answer that failed counts once)
        bar.n = answered
        bar.refresh()

    def ask(requests: List[Request]):
        answers = backend.generate(requests, on_tokens)
        pause = float(os.environ.get(PAUSE_ENV) or 0)
        if pause > 0:
            time.sleep(pause)
        return answers

    wave = max(cfg.batch_size, cfg.concurrency) * 4  # rows in flight: whole batches for every turn
    for start in range(0, len(items), wave):
        active = items[start : start + wave]
        while active:
            prompts = [(item, item.advance()) for item in active]
            finished = [item for item, prompt in prompts if prompt is None]
            asking = [(item, prompt) for item, prompt in prompts if prompt is not None]
            answers = (
                stop.call(ask, [Request(p, row_seed(cfg.seed, i.key, i.sample, i.turn), i.where) for i, p in asking])
                if asking
                else []
            )
            for (item, _), answer in zip(asking, answers):
                if answer.error is None and not answer.text.strip():
                    answer.error = "empty answer"
                if answer.error is not None:
                    item.error, item.failed = f"turn {item.turn}: {answer.error}", answer.server_error
                    answered += item.answers() - item.turn  # the turns it will not ask for
                else:
                    item.answer(answer.text, answer.token_ids, answer.finish)
                    answered += 1
            for item in finished:
                writer.add(item.row())
                stats["rows"] += 1
                stats["truncated"] += item.truncated
            for item in active:
                if item.error is not None:
                    errors.append(item.error_row())
            settle()
            complete = {id(item) for item in finished}
            active = [item for item in active if item.error is None and id(item) not in complete]


def _write_manifest(out: Path, settings: dict, backend: str, ranks: List[dict], interrupted: str) -> None:
    """The settings and the counts of every row on disk; `ranks`: each rank's errors and refused fields."""
    written = written_keys(out)
    refused: Dict[str, set] = {}
    for counts in ranks:
        for url, fields in (counts.get("refused") or {}).items():
            refused.setdefault(url, set()).update(fields)
    refused = {url: sorted(fields) for url, fields in sorted(refused.items())}
    manifest = {
        **settings,
        "token_ids": _ids_note(backend, refused),
        "counts": {
            "rows_written": len(written),
            "answer_tokens": sum(t for t, _ in written.values()),
            "truncated_answers": sum(n for _, n in written.values()),
            "errors_last_run": sum(counts.get("errors", 0) for counts in ranks),
        },
        "shards": sorted(p.name for p in out.glob(SHARD_GLOB)),
    }
    if refused:
        manifest["server_refused_fields"] = refused
    if interrupted:  # the counts so far
        manifest["interrupted"] = interrupted
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1))


def run_settings(cfg: RegenerateConfig, files: List[str], backend: str) -> dict:
    """What decides the rows written: a rerun into the same directory must have the same (the
    backend too: hf rows carry the generated ids, openai rows what the server gave)."""
    from specdraft.target.weights import target_identity

    return {
        "target": target_identity(cfg.target),
        "backend": backend,
        "sampling": asdict(cfg.sampling()),
        "seed": cfg.seed,
        "samples": cfg.samples,
        "sources": [os.path.abspath(f) for f in files],
    }


def _check_manifest(out: Path, settings: dict) -> None:
    """The directory's recorded settings are this run's (one line naming the first that differs)."""
    path = out / MANIFEST
    if not path.is_file():
        if any(out.glob(SHARD_GLOB)):
            raise SpecdraftError(
                f"{out}: holds shards but no {MANIFEST}, so their settings are unknown; use a new --out directory"
            )
        return
    old = json.loads(path.read_text())
    keys = ("target", "backend", "seed", "samples", "sources")
    recorded = {**{k: old.get(k) for k in keys}, **(old.get("sampling") or {})}
    asked = {**{k: settings[k] for k in keys}, **settings["sampling"]}
    for name, value in asked.items():
        if recorded.get(name) != value:
            if name == "sources":
                differ = sorted(set(value) ^ set(recorded.get(name) or [])) or ["their order"]
                raise SpecdraftError(
                    f"{out}: holds rows regenerated with other --data files (differing: "
                    f"{differ[0]}); use a new --out directory"
                )
            raise SpecdraftError(
                f"{out}: holds rows regenerated with other {name}: {recorded.get(name)!r} there, "
                f"{value!r} asked; rerun with the same settings or use a new --out directory"
            )


def _reasons(errors: List[dict]) -> str:
    """'too long 2, template refused 1' from the error rows' reasons."""
    counts: Dict[str, int] = {}
    for e in errors:
        short = re.sub(r"^turn \d+: ", "", e["reason"]).split(":")[0]
        counts[short] = counts.get(short, 0) + 1
    return ", ".join(f"{r} {n}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1])[:4])


def _ids_note(backend: str, refused: Dict[str, List[str]]) -> str:
    if backend == "hf":
        return "generated ids"
    return (
        "none from some servers: text tokenised"
        if any("return_token_ids" in f for f in refused.values())
        else "server ids"
    )


def _refused(backend) -> Dict[str, List[str]]:
    """The sampling fields each server refused (openai)."""
    return getattr(backend, "refused_fields", lambda: {})()


def _build_backend(cfg: RegenerateConfig):
    if cfg.backend == "openai":
        from specdraft.regenerate.openai_backend import OpenAIBackend

        tokenizer = load_target_tokenizer(cfg.target)
        return OpenAIBackend(
            cfg.servers, tokenizer, cfg.sampling(), concurrency=cfg.concurrency, model=cfg.model, timeout_s=cfg.timeout
        )
    from specdraft.regenerate.backends import HFBackend

    local = os.environ.get("LOCAL_RANK")
    device = None
    import torch

    if local is not None and torch.cuda.is_available():
        device = f"cuda:{int(local)}"
    return HFBackend.load(cfg.target, cfg.sampling(), cfg.batch_size, device)


def _progress(answers: int, enabled: bool):
    """Counted in answers, each as its batch lands (a row of several turns, or a wave of several
    batches, would hold the count back and the rate with it); no time left is shown before the
    first answer, when there is no rate to tell it from."""
    from tqdm import tqdm

    return tqdm(
        total=answers,
        unit="answer",
        disable=not enabled,
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} answers [{elapsed}<{remaining}{postfix}]",
    )
