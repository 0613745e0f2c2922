"""A feature cache directory: what it holds (manifest.json) and which shards are committed.

    cache/
      manifest.json         written once when the cache is created: format, fingerprints of the
                            target / tokenizer / template, what each stored tensor is, dtype
      parts/rank-<r>.json   the shards rank r committed, each {file, rows, tokens, bytes, sha256};
                            rewritten atomically after each shard (a crash loses no commit)
      shards/r<r>-<n>.safetensors

At the end of a capture rank 0 copies every part's shards into manifest.json's `shards`, so one
manifest covers the ranks; a reader takes the union of both, so a cache is readable at any
instant (what hybrid training and a capture killed halfway rely on).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from specdraft.errors import SpecdraftError
from specdraft.rundir.atomic import write_atomic
from specdraft.target.capture import CaptureRequest

FORMAT = 1
MANIFEST = "manifest.json"
PARTS = "parts"
SHARDS = "shards"
REJECTED = "rejected"  # rejected/<shard file name>.json: a shard a hybrid run found bad and replaced
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def stored_kinds(request: CaptureRequest) -> List[str]:
    """The tensors a cache stores per token for `request`: what the drafts read from the target's
    layers. Embeddings and rotary tables are recomputed from the target's light parts."""
    kinds = [f"hidden.{layer}" for layer in request.layers]
    if request.final_hidden:
        kinds.append("final_hidden")
    if request.last_layer_kv:
        kinds += ["last_keys", "last_values"]
    return kinds


def kind_meaning(kind: str, num_layers: int) -> str:
    if kind.startswith("hidden."):
        layer = int(kind.split(".")[1])
        if layer == num_layers:
            return f"output of the last decoder layer ({layer - 1}), before the final norm (vLLM id {layer})"
        return f"input of decoder layer {layer} (vLLM id {layer}; transformers output_hidden_states[{layer}])"
    return {
        "final_hidden": "output of the final norm: what lm_head reads",
        "last_keys": f"keys of decoder layer {num_layers - 1}, RoPE applied at the conversation's positions",
        "last_values": f"values of decoder layer {num_layers - 1}",
    }[kind]


def tokenizer_fingerprint(target_dir) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(target_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def template_fingerprint(tokenizer, thinking) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return hashlib.sha256(f"{template}\0thinking={thinking}".encode()).hexdigest()[:16]


DESCRIPTION = ("fingerprints", "kinds", "dtype", "fp8_scale", "capture_length", "num_layers")
WHAT_ROWS_HOLD = ("fingerprints", "kinds", "num_layers")  # a hybrid run adds rows at the cache's precision


@dataclass
class ShardEntry:
    file: str  # relative to the cache directory
    rows: int
    tokens: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    fingerprints: Dict[str, str]  # target, tokenizer, template
    kinds: Dict[str, str]  # stored tensor -> what it is
    dtype: str  # fp32 | bf16 | fp8
    fp8_scale: Optional[str]  # token | token_layer (fp8 only)
    capture_length: int  # a conversation's first capture_length tokens are stored
    num_layers: int
    shards: List[ShardEntry] = field(default_factory=list)  # merged at the end of a capture
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def read(cls, cache_dir: Path) -> "Manifest":
        path = Path(cache_dir) / MANIFEST
        if not path.is_file():
            raise SpecdraftError(
                f"{path}: missing: {cache_dir} is not a feature cache (`specdraft capture CONFIG` writes one)"
            )
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise SpecdraftError(f"{path}: format {raw.get('format')!r}, this specdraft reads {FORMAT}")
            raw["shards"] = [ShardEntry(**entry) for entry in raw.get("shards", [])]
            return cls(**raw)
        except (ValueError, TypeError, AttributeError) as err:
            raise SpecdraftError(f"{path}: not a feature cache manifest ({err})") from None

    def write(self, cache_dir: Path) -> None:
        write_atomic(Path(cache_dir) / MANIFEST, self.to_json())

    def same_contents(self, other: "Manifest", keys=DESCRIPTION) -> Optional[str]:
        """What differs between two manifests' descriptions of the cache (None: nothing)."""
        for key in keys:
            if getattr(self, key) != getattr(other, key):
                return f"{key} {getattr(self, key)!r}, this run's {getattr(other, key)!r}"
        return None


def part_file(cache_dir: Path, rank: int) -> Path:
    return Path(cache_dir) / PARTS / f"rank-{rank}.json"


def read_part(path: Path) -> List[ShardEntry]:
    try:
        return [ShardEntry(**entry) for entry in json.loads(path.read_text())["shards"]]
    except (ValueError, TypeError, KeyError) as err:
        raise SpecdraftError(f"{path}: not a shard list of a feature cache ({err})") from None


def committed_shards(cache_dir: Path, manifest: Manifest) -> List[ShardEntry]:
    """Every committed shard: the manifest's and every rank's part, each file once, less those a
    hybrid run rejected (their rows were committed again elsewhere)."""
    entries = {entry.file: entry for entry in manifest.shards}
    for path in sorted((Path(cache_dir) / PARTS).glob("rank-*.json")):
        for entry in read_part(path):
            known = entries.setdefault(entry.file, entry)
            if known != entry:
                raise SpecdraftError(f"{path}: {entry.file} is listed with another checksum in {MANIFEST}")
    rejected = {path.stem for path in (Path(cache_dir) / REJECTED).glob("*.json")}
    return sorted((e for e in entries.values() if Path(e.file).name not in rejected), key=lambda entry: entry.file)


def reject_shard(cache_dir: Path, entry: ShardEntry, why: str) -> None:
    """Record that a shard failed a check (write-once, so ranks never race on it)."""
    path = Path(cache_dir) / REJECTED / f"{Path(entry.file).name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"file": entry.file, "sha256": entry.sha256, "why": why}))


def commit_to_part(cache_dir: Path, rank: int, entry: ShardEntry) -> None:
    """Rank `rank` records a shard it wrote: its part file is rewritten atomically."""
    path = part_file(cache_dir, rank)
    entries = read_part(path) if path.is_file() else []
    entries.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"shards": [asdict(e) for e in entries]}, indent=1))
