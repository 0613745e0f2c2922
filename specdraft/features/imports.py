"""`specdraft capture CONFIG --from speculators|specforge --source DIR --layer-ids ...`: another
trainer's feature cache converted into a specdraft one (same manifest and shards, written with
CacheWriter), so offline training reads it as it reads its own capture.

A foreign row is matched to one of this config's rows (the conversations of the training data,
tokenised by our template) by its token ids, both cut to capture_length: the foreign trainer's
order, file names and loss masks play no part (features do not depend on the loss mask). Only the
kinds this run's drafts read are written; layer ids are the ones the user gave the other trainer
(readers in imports_speculators.py / imports_specforge.py turn them into vLLM ids).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig

from specdraft.errors import SpecdraftError
from specdraft.features.cache import CacheWriter, FeatureCache, cache_totals, prepare_cache_dir
from specdraft.features.manifest import Manifest, committed_shards
from specdraft.features.rows import row_keys
from specdraft.features.shards import CapturedRow

SOURCES = ("speculators", "specforge")
IMPORT_RECORD = "imported.json"  # what was imported from where (the manifest says what each kind is)


@dataclass
class ForeignRow:
    path: Path  # the file its features came from (named in every refusal)
    token_ids: np.ndarray  # (T,) int64
    hidden: Dict[int, torch.Tensor] = field(default_factory=dict)  # vLLM id -> (T, H)
    final_hidden: Optional[torch.Tensor] = None  # (T, H) after the final norm


@dataclass
class ImportReport:
    foreign_rows: int = 0
    written: int = 0  # our rows written (one foreign row can serve several of ours: same ids)
    already: int = 0  # our rows the cache held before
    unmatched: int = 0  # foreign rows whose ids are none of ours
    unserved: int = 0  # our rows no foreign row matched
    first_unmatched: Optional[str] = None


def parse_layer_ids(text: Optional[str]) -> List[int]:
    if not text:
        raise SpecdraftError("--layer-ids: required with --from (the layer ids the other trainer captured, e.g. 2,16,29,32)")
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecdraftError(f"--layer-ids {text!r}: not a comma-separated list of integers") from None
    if len(set(ids)) != len(ids):
        raise SpecdraftError(f"--layer-ids {text!r}: an id appears twice")
    return ids


def vllm_layer_ids(source: str, layer_ids: Sequence[int], num_layers: int) -> List[int]:
    """The user's ids (the other trainer's numbering) as vLLM ids: speculators uses vLLM's; SpecForge's
    id k is the output of decoder layer k, the input of layer k + 1."""
    shift = {"speculators": 0, "specforge": 1}[source]
    top = num_layers - shift
    for layer in layer_ids:
        if not 0 <= layer <= top:
            raise SpecdraftError(f"--layer-ids: {layer} is no {source} layer id of this {num_layers}-layer target (0..{top})")
    return [layer + shift for layer in layer_ids]


def foreign_rows(source: str, source_dir: Path, vllm_ids: Sequence[int]) -> Iterator[ForeignRow]:
    if source == "speculators":
        from specdraft.features.imports_speculators import speculators_rows

        return speculators_rows(source_dir, vllm_ids)
    from specdraft.features.imports_specforge import specforge_rows

    return specforge_rows(source_dir, vllm_ids)


class FinalNorm:
    """The target's final norm, built by transformers' class of the target at 0 layers (as
    target/light.py does) with its weights read from the checkpoint: what turns vLLM id L (the
    last layer's output) into what lm_head reads, for a cache that stores only the former."""

    def __init__(self, target_dir: str):
        import copy

        from transformers import AutoModelForCausalLM

        from specdraft.target.checks import load_target_config
        from specdraft.target.weights import load_target_tensors

        shallow = copy.deepcopy(load_target_config(target_dir))
        text = shallow.get_text_config()
        text.num_hidden_layers = 0
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = []
        model = AutoModelForCausalLM.from_config(shallow, dtype=torch.float32)
        name = next(n for n, _ in model.named_modules() if n.endswith(".norm") and n.count(".") <= 2)
        self.norm = model.get_submodule(name)
        tensors = load_target_tensors(target_dir, f"{name}.", torch.float32)
        if not tensors:
            raise SpecdraftError(f"{target_dir}: no {name}.* tensors in the checkpoint (the final norm to apply to layer id L)")
        self.norm.load_state_dict({key[len(name) + 1 :]: value for key, value in tensors.items()})
        self.norm.eval()

    @torch.no_grad()
    def __call__(self, last: torch.Tensor) -> torch.Tensor:
        return self.norm(last.float()[None])[0]


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
        raise SpecdraftError(f"{source_dir}: this run's drafts read the last layer's keys and values, which {source} does not store")
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
        manifest.kinds["final_hidden"] += f" (imported: the target's final norm applied to {source}'s layer id {num_layers})"
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
        ours[_ids_bytes(data.conversation(row)[0][:capture_length])].append(row)
    cache = FeatureCache(cache_dir, Manifest.read(cache_dir), list(manifest.kinds))
    writer = CacheWriter(cache_dir, cache.manifest, 0, cfg.feature_cache_shard_tokens)
    norm = FinalNorm(cfg.target) if norm_from_last else None
    report = ImportReport()
    served = set()
    for foreign in foreign_rows(source, source_dir, vllm_ids):
        report.foreign_rows += 1
        ids = np.asarray(foreign.token_ids, dtype=np.int64)[:capture_length]
        matches = ours.get(_ids_bytes(ids), [])
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
        values = _row_values(foreign, manifest.kinds, norm, num_layers, len(ids), target_config.get_text_config().hidden_size)
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
        json.dumps({"from": source, "source": str(source_dir), "layer_ids": layer_ids, "report": vars(report)}, indent=1)
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


def _ids_bytes(ids) -> bytes:
    return np.ascontiguousarray(ids, dtype=np.int64).tobytes()


def _row_values(
    foreign: ForeignRow, kinds, norm: Optional[FinalNorm], num_layers: int, length: int, hidden_size: int
) -> Dict[str, torch.Tensor]:
    values = {}
    for kind in kinds:
        if kind.startswith("hidden."):
            value = foreign.hidden[int(kind.split(".")[1])]
        elif foreign.final_hidden is not None:
            value = foreign.final_hidden
        else:  # speculators: the last state before the norm (checked present by its reader)
            value = norm(foreign.hidden[num_layers])
        if value.shape[-1] != hidden_size or value.shape[0] < length:
            raise SpecdraftError(
                f"{foreign.path}: {kind} has shape {tuple(value.shape)}, expected ({length}+, {hidden_size})"
            )
        values[kind] = value[:length].contiguous()
    return values
