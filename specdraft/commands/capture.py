"""`specdraft capture CONFIG [key=value ...]`: the frozen target run once over the training rows,
its features written to `feature_cache` for any number of offline runs (train with the same
config, or any config whose drafts read a subset of them).

The rows are packed as training packs them (packing: whole, document masks: the same windows, the
same target pass), and each conversation's features are stored apart, its first max_seq_length
tokens. Windows are dealt to ranks (window w to rank w mod world size); each rank writes its own
shards and commits each in its part file. A rerun after a kill, at any world size, captures only
the conversations no committed shard holds, so each ends up in the cache exactly once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from specdraft.errors import SpecdraftError
from specdraft.features.cache import CacheWriter, FeatureCache, cache_totals, prepare_cache_dir
from specdraft.features.manifest import Manifest, committed_shards
from specdraft.features.rows import row_keys
from specdraft.features.shards import CapturedRow, bytes_per_token
from specdraft.features.step import features_to_store
from specdraft.parallel.collectives import all_reduce, run_shared
from specdraft.target.checks import load_target_config
from specdraft.target.model import load_frozen_target, load_target_tokenizer
from specdraft.train.data import prepare_data
from specdraft.train.engine import init_distributed
from specdraft.train.features import expected_manifest, run_capture_request
from specdraft.train.loop import device_inputs, model_inputs
from specdraft.train.model import target_features


def capture(cfg: DictConfig, log=print) -> dict:
    """-> {"rows", "tokens", "shards", "bytes"} this call wrote (all ranks)."""
    from tqdm import tqdm

    if cfg.feature_cache is None:
        raise SpecdraftError("key 'feature_cache': the directory to write the features into is required")
    rank, world = init_distributed()
    log = log if rank == 0 else (lambda *_: None)
    cache_dir = Path(cfg.feature_cache)
    tokenizer = load_target_tokenizer(cfg.target)
    target_config = load_target_config(cfg.target)
    manifest = expected_manifest(cfg, tokenizer, target_config, run_capture_request(cfg, target_config))
    run_shared(lambda: prepare_cache_dir(cache_dir, manifest, log))
    data = prepare_data(cfg, tokenizer, rank, log)
    kinds = list(manifest.kinds)
    cache = FeatureCache(cache_dir, Manifest.read(cache_dir), kinds)
    keys = row_keys(data)
    lengths = [int(min(n, data.window)) for n in data.lengths]
    todo = [
        w
        for w in range(rank, len(data), world)
        if cache.missing([keys[p.row] for p in data.placements(w)], [p.length for p in data.placements(w)])
    ]
    todo_tokens = sum(p.length for w in todo for p in data.placements(w) if cache.missing([keys[p.row]], [p.length]))
    all_tokens = int(all_reduce(torch.tensor(todo_tokens, dtype=torch.long)).item())
    widths = _kind_widths(target_config, kinds)
    per_token = bytes_per_token(widths, manifest.dtype, manifest.fp8_scale or "token")
    log(
        f"capture: {len(kinds)} tensors per token ({', '.join(kinds)}), {manifest.dtype}: {per_token:,} bytes per "
        f"token; {all_tokens:,} tokens of {sum(lengths):,} to capture -> {per_token * all_tokens / 2**30:.2f} GiB "
        f"into {cache_dir}"
    )
    target = load_frozen_target(cfg.target, cfg.precision, _device())
    writer = CacheWriter(cache_dir, cache.manifest, rank, cfg.feature_cache_shard_tokens)
    request = run_capture_request(cfg, target_config)
    written_rows = 0
    with tqdm(total=todo_tokens, disable=rank != 0, desc="capture", unit="tok", unit_scale=True) as progress:
        for start in range(0, len(todo), cfg.per_device_batch_size):
            windows = todo[start : start + cfg.per_device_batch_size]
            batch = model_inputs(data.batch(windows), document_mask=True)
            device = next(target.parameters()).device
            inputs = device_inputs(batch, device)
            features = target_features(
                target.model,
                request,
                inputs["input_ids"],
                inputs.get("document_positions"),
                inputs.get("document_ids"),
            )
            stored = {kind: value.cpu() for kind, value in features_to_store(features, kinds).items()}
            for b, window in enumerate(windows):
                for place in data.placements(window):
                    key = keys[place.row]
                    if not cache.missing([key], [place.length]) or key in writer.pending:
                        continue
                    ids = np.asarray(data.conversation(place.row)[0][: place.length], dtype=np.int64)
                    values = {k: v[b, place.offset : place.offset + place.length].clone() for k, v in stored.items()}
                    writer.add(CapturedRow(key, ids, values))
                    written_rows += 1
                    progress.update(place.length)
        writer.flush()
    totals = torch.tensor([written_rows, todo_tokens, len(writer.committed), sum(e.bytes for e in writer.committed)])
    rows, tokens, shards, written = (int(x) for x in all_reduce(totals))
    run_shared(lambda: _merge_parts(cache_dir))
    all_shards, all_rows, all_tokens_cached, all_bytes = cache_totals(cache_dir, Manifest.read(cache_dir))
    log(
        f"capture: wrote {rows} conversations ({tokens:,} tokens) in {shards} shards, {written / 2**20:.1f} MiB; "
        f"{cache_dir} holds {all_rows} conversations, {all_tokens_cached:,} tokens in {all_shards} shards "
        f"({all_bytes / max(all_tokens_cached, 1):,.0f} bytes per token)"
    )
    return {"rows": rows, "tokens": tokens, "shards": shards, "bytes": written}


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(get_accelerator().current_device_name())


def _kind_widths(target_config, kinds) -> dict:
    text = target_config.get_text_config()
    hidden = text.hidden_size
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    return {
        kind: hidden if kind.startswith("hidden.") or kind == "final_hidden" else heads * head_dim for kind in kinds
    }


def _merge_parts(cache_dir: Path) -> None:
    """Rank 0, after every rank's last commit: manifest.json lists every shard (one manifest)."""
    manifest = Manifest.read(cache_dir)
    manifest.shards = committed_shards(cache_dir, manifest)
    manifest.write(cache_dir)
