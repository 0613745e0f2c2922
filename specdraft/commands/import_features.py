"""`specdraft capture CONFIG --from speculators|specforge --source DIR --layer-ids ...`: the run's
side of an import (its rows, its drafts' request, the cache it writes); the readers and the
matching live in features/imports*.py."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from omegaconf import DictConfig

from specdraft.errors import SpecdraftError
from specdraft.features.cache import CacheWriter, FeatureCache, cache_totals, prepare_cache_dir
from specdraft.features.imports import (
    IMPORT_RECORD,
    SOURCES,
    FinalNorm,
    ImportReport,
    ids_bytes,
    row_values,
    foreign_rows,
    parse_layer_ids,
    vllm_layer_ids,
)
from specdraft.features.manifest import Manifest, committed_shards
from specdraft.features.rows import row_keys
from specdraft.features.shards import CapturedRow


def import_cache(
    cfg: DictConfig, source: str, source_dir, layer_ids_text: Optional[str], strict: bool = False, log=print
) -> ImportReport:
    from specdraft.target.checks import load_target_config
    from specdraft.target.model import load_target_tokenizer
    from specdraft.train.data import prepare_data
    from specdraft.train.engine import init_distributed
    from specdraft.train.features import expected_manifest, run_capture_request

    if cfg.feature_cache is None:
        raise SpecdraftError("key 'feature_cache': the directory to write the imported features into is required")
    if cfg.packing != "whole":
        raise SpecdraftError(f"key 'packing': {cfg.packing!r}; a feature cache serves packing=whole runs only")
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        raise SpecdraftError(f"{source_dir}: --source is not a directory")
    if source not in SOURCES:
        raise SpecdraftError(f"--from {source!r}: one of {', '.join(SOURCES)}")
    layer_ids = parse_layer_ids(layer_ids_text)
    init_distributed()
    tokenizer = load_target_tokenizer(cfg.target)
    target_config = load_target_config(cfg.target)
    num_layers = target_config.get_text_config().num_hidden_layers
    request = run_capture_request(cfg, target_config)
    manifest = expected_manifest(cfg, tokenizer, target_config, request)
    if request.last_layer_kv:
        raise SpecdraftError(
            f"{source_dir}: this run's drafts read the last layer's keys and values, which {source} does not store"
        )
    vllm_ids = vllm_layer_ids(source, layer_ids, num_layers)
    for layer in request.layers:
        if layer not in vllm_ids:
            raise SpecdraftError(
                f"{source_dir}: this run's drafts read layer id {layer} (vLLM numbering), the {source} cache holds "
                f"{vllm_ids}: capture those layers, or train drafts that read these"
            )
    norm_from_last = request.final_hidden and source == "speculators"
    if norm_from_last and num_layers not in vllm_ids:
        raise SpecdraftError(
            f"{source_dir}: this run's drafts read the final norm's output; the speculators cache holds layer ids "
            f"{vllm_ids}, not {num_layers} (the last layer's output it is computed from)"
        )
    if norm_from_last:
        manifest.kinds["final_hidden"] += (
            f" (imported: the target's final norm applied to {source}'s layer id {num_layers})"
        )
    for kind in manifest.kinds:
        if kind.startswith("hidden."):
            manifest.kinds[kind] += f" (imported from {source})"
    cache_dir = Path(cfg.feature_cache)
    prepare_cache_dir(cache_dir, manifest, log)  # a rerun continues (same manifest), as capture's
    data = prepare_data(cfg, tokenizer, 0, log)
    capture_length = manifest.capture_length
    keys = row_keys(data)
    ours: Dict[bytes, List[int]] = defaultdict(list)  # token ids cut to capture_length -> our rows
    for row in range(len(keys)):
        ours[ids_bytes(data.conversation(row)[0][:capture_length])].append(row)
    cache = FeatureCache(cache_dir, Manifest.read(cache_dir), list(manifest.kinds))
    writer = CacheWriter(cache_dir, cache.manifest, 0, cfg.feature_cache_shard_tokens)
    norm = FinalNorm(cfg.target) if norm_from_last else None
    report = ImportReport()
    served = set()
    for foreign in foreign_rows(source, source_dir, vllm_ids):
        report.foreign_rows += 1
        ids = np.asarray(foreign.token_ids, dtype=np.int64)[:capture_length]
        matches = ours.get(ids_bytes(ids), [])
        if not matches:
            report.unmatched += 1
            report.first_unmatched = report.first_unmatched or str(foreign.path)
            if strict:
                raise SpecdraftError(
                    f"{foreign.path}: its {len(foreign.token_ids)} token ids are no conversation of this config's "
                    f"data (tokenised by this target's template, cut to {capture_length}); nothing more was imported"
                )
            continue
        todo = [r for r in matches if keys[r] not in served and cache.missing([keys[r]], [len(ids)])]
        report.already += len(matches) - len(todo)
        if not todo:
            continue
        values = row_values(
            foreign, manifest.kinds, norm, num_layers, len(ids), target_config.get_text_config().hidden_size
        )
        for row in todo:
            writer.add(CapturedRow(keys[row], ids, values))
            served.add(keys[row])
            report.written += 1
    writer.flush()
    merged = Manifest.read(cache_dir)  # one manifest lists every shard, as at the end of a capture
    merged.shards = committed_shards(cache_dir, merged)
    merged.write(cache_dir)
    cache.refresh()
    lengths = [int(min(n, data.window)) for n in data.lengths]
    report.unserved = len(cache.missing(keys, lengths))
    (cache_dir / IMPORT_RECORD).write_text(
        json.dumps(
            {"from": source, "source": str(source_dir), "layer_ids": layer_ids, "report": vars(report)}, indent=1
        )
    )
    shards, all_rows, tokens, size = cache_totals(cache_dir, Manifest.read(cache_dir))
    log(
        f"import: {report.foreign_rows} {source} rows read, {report.written} conversations written, "
        f"{report.unmatched} matched none of this config's conversations"
        + (f" (the first: {report.first_unmatched})" if report.first_unmatched else "")
        + f"; {cache_dir} holds {all_rows} conversations ({tokens:,} tokens, {shards} shards, {size / 2**20:.1f} MiB), "
        f"{report.unserved} of {len(keys)} still missing"
    )
    return report
