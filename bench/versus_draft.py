"""A draft speculators' trainer saved, read back as a specdraft export that `specdraft eval` (and
decode/measure.py) measures like one of ours.

    python bench/versus_draft.py SPEC_SAVE/0 OUT [--config FILE] target=DIR data_files=[...]
    specdraft eval OUT --prompts PROMPTS --gamma 3

`specdraft eval` reads only our exports: a directory whose config.json has no "architecture" is
taken for a target model (commands/evaluate.py resolve_export). So the checkpoint goes through
the import a run's `draft.init_from` makes (export/init_from.py read_init_from: its names mapped
to ours, every tensor's shape and every recorded setting checked against the draft the keys
build), is loaded strictly into that draft and written by write_draft_export, as a run's step
export is. The draft keys come from the checkpoint's own config.json (speculators_draft_keys):
its layer ids and norm flags through the family's speculators format reader, its draft vocab,
its TTT depth (EAGLE-3) or layers and block (DFlash, and DSpark's Markov rank); nothing is guessed.

speculators saves the weights in bfloat16 whatever it trained in (train/checkpointer.py:339-351,
float_dtype default torch.bfloat16; train/trainer.py:690 passes none): the export holds those
values, widened to the draft's dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))


def override(key: str, value: Any) -> str:
    """key=value as specdraft's command line reads it (lists in brackets, booleans lower case)."""
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, (list, tuple)):
        return f"{key}=[{','.join(str(v) for v in value)}]"
    return f"{key}={value}"


def speculators_draft_keys(config: Dict[str, Any]) -> List[str]:
    """The `draft.` keys of the draft a speculators config.json describes."""
    from specdraft.drafts.registry import FAMILIES

    family = config["speculators_model_type"]
    if family not in ("eagle3", "dflash", "dspark"):
        raise SystemExit(f"speculators_model_type {family!r}: versus reads eagle3, dflash and dspark drafts")
    recorded = FAMILIES[family].file_formats["speculators"].settings(config)
    keys = {"type": family, **recorded}
    layer = config["transformer_layer_config"]
    if config.get("draft_vocab_size") not in (None, layer["vocab_size"]):
        keys["draft_vocab_size"] = config["draft_vocab_size"]
    if family == "eagle3":
        keys["ttt_steps"] = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    else:  # DFlash's block backbone; DSpark's heads besides (their other fields are recorded ones)
        keys["num_layers"] = layer["num_hidden_layers"]
        keys["block_size"] = config["block_size"]
        if family == "dspark":
            keys["markov_rank"] = config["markov_rank"]
    return [override(f"draft.{key}", value) for key, value in keys.items()]


def import_speculators(checkpoint, out, config_file=None, overrides: Sequence[str] = (), log=print) -> Path:
    """speculators' <save-path>/<epoch>/ -> our export at `out` (returned)."""
    from specdraft.config.load import load_config
    from specdraft.drafts.registry import build_draft
    from specdraft.export.files import write_draft_export
    from specdraft.export.init_from import read_init_from
    from specdraft.target.checks import load_target_config

    checkpoint = Path(checkpoint)
    keys = speculators_draft_keys(json.loads((checkpoint / "config.json").read_text()))
    cfg = load_config(config_file, [*overrides, *keys, f"draft.init_from={checkpoint.resolve()}"])
    target_config = load_target_config(cfg.target)
    imported = read_init_from(cfg, target_config)
    draft = build_draft(cfg.draft, target_config)
    draft.load_state_dict(imported.state, strict=True)
    path = write_draft_export(Path(out), draft.state_dict(), draft, cfg, serving=[])
    log(f"versus draft: {imported.fmt} {imported.path} ({len(imported.state)} tensors; {' '.join(keys)}) -> {path}")
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", type=Path, help="speculators' <save-path>/<epoch>/ (config.json, model.safetensors)"
    )
    parser.add_argument("out", type=Path, help="the export to write")
    parser.add_argument("--config", default=None, help="specdraft run config (YAML) the key=value pairs override")
    parser.add_argument("overrides", nargs="*", help="specdraft config key=value (target=, data_files=, ...)")
    args = parser.parse_intermixed_args(argv)
    from specdraft.errors import SpecdraftError

    try:
        import_speculators(args.checkpoint, args.out, args.config, args.overrides)
    except SpecdraftError as err:
        raise SystemExit(f"versus_draft: {err}") from None


if __name__ == "__main__":
    main()
