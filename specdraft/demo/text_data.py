"""Training text that costs no regeneration: the standard library's functions as written, as chats
(the prompt a held-out row would ask, the function's own body as the answer).

With a distillation objective (draft.loss kl, tv, soft_ce ... : a teacher term) a draft learns the
target's own distribution at every answer token, computed online from the target's logits on this
text, so any text teaches it what the target would say there; CE would teach the text itself. The
regenerated answers (dataset.py) are the target's own words: right for CE and for the positions a
draft meets while serving, but they cost the target's generation (~70 answer tokens/s on one CPU
core for SmolLM2). The held-out prompts are never in this text.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specdraft.demo.cache import building, log_stderr, read_stamp, reuse_or_build
from specdraft.demo.corpus import extract_functions, read_corpus
from specdraft.demo.presets import get_preset
from specdraft.drafts import family_keys

TEXT = "text"  # beside the preset's target/ and data/
TEXT_BYTES = 4_000_000  # stdlib text read (~2,400 documented functions on Python 3.11)
TEXT_FILES = 4


def text_inputs(preset: str, seed: int, prompts_file: Path) -> dict:
    """What the text depends on: the preset's corpus and seed, and the held-out prompts it avoids."""
    return {
        "kind": "text",
        "preset": get_preset(preset).fingerprint(),
        "seed": seed,
        "bytes": TEXT_BYTES,
        "held_out": hashlib.sha256(Path(prompts_file).read_bytes()).hexdigest()[:16],
    }


def text_rows(seed: int, held_out: set) -> list:
    """One chat per documented stdlib function whose prompt is not held out, in corpus order."""
    return [
        {"conversations": [{"role": "user", "content": f.prompt}, {"role": "assistant", "content": f.answer}]}
        for f in extract_functions(read_corpus(TEXT_BYTES, seed))
        if f.prompt not in held_out
    ]


def ensure_text_data(root: Path, preset: str, prompts_file: Path, seed: int, log=log_stderr) -> list:
    """root/<preset>/text/shard-*.jsonl, none of prompts_file's prompts in it, built on first use
    (seconds: nothing is generated)."""
    out_dir = Path(root) / preset / TEXT
    stamp = text_inputs(preset, seed, prompts_file)

    def build():
        held_out = {json.loads(line)["prompt"] for line in Path(prompts_file).read_text().splitlines()}
        rows = text_rows(seed, held_out)
        with building(out_dir, stamp, log) as tmp:
            per_file = -(-len(rows) // TEXT_FILES)
            names = []
            for i in range(0, len(rows), per_file):
                names.append(f"shard-{i // per_file:05d}.jsonl")
                (tmp / names[-1]).write_text("".join(json.dumps(r) + "\n" for r in rows[i : i + per_file]))
            stamp.update(rows=len(rows), files=names)
        log(f"[demo] {len(rows)} stdlib functions as written, for distillation, in {out_dir}")

    reuse_or_build(out_dir, stamp, build, "text", log)
    return [out_dir / name for name in read_stamp(out_dir)["files"]]


def distillation_overrides(config_path) -> list:
    """`draft.loss=kl` for a config whose family learns by CE unless told otherwise (GLIDE, DFlash);
    none where the family's default already reads the target's distribution (EAGLE-3's soft CE,
    P-EAGLE's KL, DSpark's TV) or it sets draft.loss itself."""
    from omegaconf import OmegaConf

    from specdraft.drafts import DEFAULT_FAMILY, draft_family

    draft = OmegaConf.load(config_path).get("draft") or {}
    family = draft_family(str(draft.get("type", DEFAULT_FAMILY)))
    if draft.get("loss") is not None or family.default_loss != "ce" or "loss" not in family_keys(family):
        return []
    return ["draft.loss=kl"]
