"""The feature cache as a run sees it (`feature_cache:`): the cache the run expects, each
micro-batch's cached features, and in hybrid mode the rows computed live committed to it.

    run_cache = open_run_cache(cfg, tokenizer, data, target_config, rank, log)   # before step 1
    cached = run_cache.batch(indices)          # kind -> (B, T, ...), or None: compute it live
    run_cache.commit_live(indices, features)   # hybrid: the rows the cache lacks, into shards

Hybrid mode trains a live batch on its features rounded to the cache's dtype, exactly what a
later read of them gives: a batch's loss does not depend on whether its rows were computed or read
(so a resume that now reads what the run before it computed repeats its losses bit for bit).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from omegaconf import DictConfig

from specdraft.config import draft_names, draft_view
from specdraft.drafts.base import CaptureRequest
from specdraft.drafts.registry import build_draft
from specdraft.errors import SpecdraftError
from specdraft.parallel.collectives import run_shared
from specdraft.features.cache import CacheWriter, FeatureCache, prepare_cache_dir
from specdraft.features.manifest import (
    Manifest,
    kind_meaning,
    stored_kinds,
    template_fingerprint,
    tokenizer_fingerprint,
)
from specdraft.features.rows import row_keys
from specdraft.features.shards import CapturedRow, decode_value, encode_values
from specdraft.features.step import features_to_store
from specdraft.target.capture import TargetFeatures
from specdraft.target.weights import target_identity


def run_capture_request(cfg: DictConfig, target_config) -> CaptureRequest:
    """The union of what the run's drafts read from the target (drafts built on the meta device:
    their requests follow from their configs, no weights are made)."""
    with torch.device("meta"):
        drafts = [build_draft(draft_view(cfg, name).draft, target_config) for name in draft_names(cfg)]
    return functools.reduce(CaptureRequest.merged, [d.capture_request() for d in drafts])


def expected_manifest(cfg: DictConfig, tokenizer, target_config, request: CaptureRequest) -> Manifest:
    num_layers = target_config.get_text_config().num_hidden_layers
    return Manifest(
        fingerprints={
            "target": target_identity(cfg.target),
            "tokenizer": tokenizer_fingerprint(cfg.target),
            "template": template_fingerprint(tokenizer, cfg.thinking),
        },
        kinds={kind: kind_meaning(kind, num_layers) for kind in stored_kinds(request)},
        dtype=cfg.feature_cache_dtype,
        fp8_scale=cfg.feature_cache_fp8_scale if cfg.feature_cache_dtype == "fp8" else None,
        capture_length=cfg.max_seq_length,
        num_layers=num_layers,
    )


class RunFeatures:
    def __init__(self, cfg: DictConfig, cache: FeatureCache, data, writer: Optional[CacheWriter], dtype):
        self.cache = cache
        self.data = data
        self.keys = row_keys(data)
        self.writer = writer  # hybrid only
        self.dtype = dtype
        self.hybrid = writer is not None

    @property
    def offline(self) -> bool:
        return not self.hybrid

    def missing_rows(self) -> List[int]:
        rows = range(len(self.keys))
        return [
            rows[i] for i in self.cache.missing(self.keys, [int(min(n, self.data.window)) for n in self.data.lengths])
        ]

    def batch(self, indices) -> Optional[Dict[str, torch.Tensor]]:
        self.indices = indices  # the windows a live pass of this batch computes (on_live)
        cached = self.cache.window_features(self.data, self.keys, indices, self.dtype)
        if cached is None and self.hybrid:
            wanted = {self.keys[p.row] for w in np.asarray(indices) for p in self.data.placements(int(w))}
            if wanted & self.writer.pending:  # rows this rank computed and still holds: committed, then read
                self.writer.flush()
            self.cache.refresh()  # another rank may have committed them since
            cached = self.cache.window_features(self.data, self.keys, indices, self.dtype)
        if cached is None and not self.hybrid:  # refused before step 1 (missing_rows): never here
            raise SpecdraftError(f"{self.cache.cache_dir}: a row of windows {list(indices)} is not in the cache")
        return cached

    def as_stored(self, features: TargetFeatures) -> TargetFeatures:
        """Hybrid: the live features rounded to the cache's dtype (what reading them back gives)."""
        kinds = list(self.cache.manifest.kinds)
        manifest = self.cache.manifest
        stored = features_to_store(features, kinds)
        rounded = {}
        for kind, value in stored.items():
            flat = value.reshape(-1, *value.shape[2:])
            encoded = encode_values({kind: flat}, manifest.dtype, manifest.fp8_scale or "token")
            rounded[kind] = decode_value(encoded, kind, 0, flat.shape[0], value.dtype).reshape(value.shape)
        if features.final_hidden is not None and "final_hidden" in rounded:
            features.final_hidden = rounded["final_hidden"]
        features.hidden = {layer: rounded.get(f"hidden.{layer}", h) for layer, h in features.hidden.items()}
        if features.last_keys is not None:
            features.last_keys = rounded["last_keys"].transpose(1, 2)
            features.last_values = rounded["last_values"].transpose(1, 2)
        return features

    def on_live(self, features: TargetFeatures) -> TargetFeatures:
        """Hybrid, a live pass of the last batch: its rows the cache lacks committed, and its
        features as the cache holds them."""
        self.commit_live(self.indices, features)
        return self.as_stored(features)

    def commit_live(self, indices, features: TargetFeatures) -> None:
        """Hybrid: the rows of these windows the cache lacks, from this batch's live features."""
        kinds = list(self.cache.manifest.kinds)
        stored = {kind: value.detach().cpu() for kind, value in features_to_store(features, kinds).items()}
        for b, window in enumerate(np.asarray(indices)):
            for place in self.data.placements(int(window)):
                key = self.keys[place.row]
                if not self.cache.missing([key], [place.length]) or key in self.writer.pending:
                    continue
                ids = np.asarray(self.data.conversation(place.row)[0][: place.length], dtype=np.int64)
                values = {k: v[b, place.offset : place.offset + place.length].clone() for k, v in stored.items()}
                self.writer.add(CapturedRow(key, ids, values))
                if not self.writer.builder.rows:  # a shard was just committed: index it
                    self.cache.refresh()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.cache.refresh()


def open_run_cache(cfg: DictConfig, tokenizer, data, target_config, rank: int, log) -> RunFeatures:
    """The run's feature cache, checked before step 1: its manifest against this run's target,
    tokenizer, template and drafts; offline, every training row must be in it."""
    request = run_capture_request(cfg, target_config)
    expected = expected_manifest(cfg, tokenizer, target_config, request)
    if cfg.feature_cache_mode == "hybrid":  # a new directory becomes the cache the run fills
        run_shared(lambda: prepare_cache_dir(Path(cfg.feature_cache), expected, log, hybrid=True))
    hybrid = cfg.feature_cache_mode == "hybrid"
    cache = FeatureCache.open(cfg.feature_cache, expected, list(expected.kinds), recompute=log if hybrid else None)
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    writer = None
    if cfg.feature_cache_mode == "hybrid":
        writer = CacheWriter(Path(cfg.feature_cache), cache.manifest, rank, cfg.feature_cache_shard_tokens)
    features = RunFeatures(cfg, cache, data, writer, dtype)
    missing = features.missing_rows()
    if missing and features.offline:
        row = missing[0]
        raise SpecdraftError(
            f"{cfg.feature_cache}: {len(missing)} of {len(features.keys)} conversations of the data are not in "
            f"the cache (the first: row {row}, {int(data.lengths[row])} tokens; a cache captured with a "
            f"shorter max_seq_length stores fewer); run `specdraft capture` with this config, or "
            f"feature_cache_mode: hybrid"
        )
    log(
        f"features: {cfg.feature_cache_mode} from {cfg.feature_cache} ({cache.manifest.dtype}, "
        f"{len(features.keys) - len(missing)} of {len(features.keys)} conversations cached)"
    )
    return features
