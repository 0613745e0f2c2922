"""The rows specdraft trains on, written in speculators' offline layout for `speculators train`.

    python bench/versus_features.py OUT --layers 0,1,2 [--draft-vocab-size 256] [--val-rows 1]
        [--config FILE] target=DIR data_files=[a.jsonl,b.jsonl] max_seq_length=256 [feature_cache=DIR]

The key=value pairs (and --config) are specdraft's run configuration, the one `specdraft train`
is given; packing is whole, as for a feature cache. OUT is speculators' --data-path
(speculators 0.9.0, site-packages/speculators/):

    OUT/
      state.json, dataset_info.json,    the Arrow dataset, written by `datasets` itself
      data-00000-of-00001.arrow         (save_to_disk, in the speculators venv, torch format):
                                        input_ids, loss_mask, seq_len per row; train/data.py:164
                                        load_from_disk, :314 token_ids == input_ids, :332 its loss_mask
      hidden_states/hs_{i}.safetensors  row i: hidden_states [T, n_layers, H] (the --layers, then
                                        id L), token_ids [T] int64; train/data.py:184 (the file
                                        backend's directory), :324-331 slots [:-1] fuse, slot -1 is
                                        verifier_last_hidden_states
      token_freq.pt                     {target id: count} over loss-masked tokens, the file
                                        train/vocab_mapping.py:20-56 writes
      d2t-N.npy, t2d-N.npy              the draft vocab, read by train/cli.py:411-418 for
                                        --draft-vocab-size N (and by --d2t-path / --t2d-path)
      versus.json                       what was written: rows, slots, dtype, train_data_ratio

Rows: specdraft's own data pipeline (train/data.py prepare_data, packing whole): each conversation
once, its first max_seq_length tokens and their loss mask, the rows `specdraft capture` stores and
an offline run trains on. Layer ids are vLLM's: id i is the input of decoder layer i, id L the
last layer's output before the final norm (speculators recomputes the teacher as
lm_head(norm(slot -1)), models/eagle3/core.py:250-253).

Features: with feature_cache set, converted from that cache (FeatureCache.window_features: the
values specdraft's offline run reads, decoded to --dtype); else computed by the target pass
`specdraft capture` makes (train/model.target_features over the whole-packed windows, document
masks). Either way the cache or the pass must hold every id: the --layers and L.

Vocabulary: the counts and the maps are specdraft's own (drafts/eagle3/vocab.py
count_target_tokens, vocab_maps) over the same rows, so a specdraft run with draft_vocab_size N
on this data builds these very d2t/t2d; speculators' build from token_freq.pt picks the same ids
(train/vocab_mapping.py:81-96: most frequent first, ties and padding to the lower id).

Validation: speculators always holds rows out (train/dataloader.py:129-130, train_data_ratio in
(0, 1); train/data.py:172 split_idx = int(len * ratio)). --val-rows K appends copies of the first
K rows, and versus.json's train_data_ratio (n + 0.5) / (n + K) keeps exactly the n rows for
training. --val-rows 0 writes the n rows alone (speculators' default 0.9 then trains on 90%).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Optional, Sequence, Tuple

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from speculators_train import PYTHON_VAR, speculators_env, speculators_python  # noqa: E402

HIDDEN_STATES = "hidden_states"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# run by the speculators venv's python: `datasets` lives there only
SAVE_DATASET = """
import json, sys, datasets
columns = json.load(open(sys.argv[1]))
dataset = datasets.Dataset.from_dict(columns)
dataset.set_format("torch")  # kept in state.json: rows come back as tensors (train/data.py:314)
dataset.save_to_disk(sys.argv[2])
"""


# -- the rows ------------------------------------------------------------------------------------


def run_config(config_file, overrides: Sequence[str]):
    from specdraft.config.load import load_config

    return load_config(config_file, [*overrides, "packing=whole"])


def window_features(cfg, data, slots: Sequence[int], dtype) -> Iterator[Tuple[int, Dict[int, torch.Tensor]]]:
    """(window, {layer id: (T, H)}) for every window, from cfg.feature_cache or a live pass."""
    from specdraft.target.capture import CaptureRequest
    from specdraft.target.checks import load_target_config
    from specdraft.target.model import load_target_tokenizer

    request = CaptureRequest(layers=tuple(sorted(set(slots))))
    kinds = [f"hidden.{layer}" for layer in request.layers]
    if cfg.feature_cache is not None:
        from specdraft.features.cache import FeatureCache
        from specdraft.features.rows import row_keys
        from specdraft.train.features import expected_manifest

        expected = expected_manifest(cfg, load_target_tokenizer(cfg.target), load_target_config(cfg.target), request)
        cache = FeatureCache.open(cfg.feature_cache, expected, kinds)  # refuses another target, a missing id
        keys = row_keys(data)
        for w in range(len(data)):
            cached = cache.window_features(data, keys, [w], dtype)
            if cached is None:
                raise SystemExit(f"{cfg.feature_cache}: a conversation of window {w} is not in the cache")
            yield w, {layer: cached[f"hidden.{layer}"][0] for layer in request.layers}
        return
    from specdraft.target.model import load_frozen_target
    from specdraft.train.loop import model_inputs
    from specdraft.train.model import target_features

    target = load_frozen_target(cfg.target, cfg.precision, torch.device("cpu"))
    with torch.no_grad():
        for w in range(len(data)):
            batch = model_inputs(data.batch([w]), document_mask=True)  # as commands/capture.py
            features = target_features(
                target.model, request, batch["input_ids"], batch.get("document_positions"), batch.get("document_ids")
            )
            yield w, {layer: features.hidden[layer][0].to(dtype) for layer in request.layers}


# -- the files -----------------------------------------------------------------------------------


def write_rows(hs_dir: Path, data, windows, slots: Sequence[int]) -> Dict[str, list]:
    """hs_{i}.safetensors of every conversation, window by window -> the dataset's columns."""
    from safetensors.torch import save_file

    columns = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for w, hidden in windows:
        for place in data.placements(w):
            ids, mask = data.conversation(place.row)
            ids = np.asarray(ids[: place.length], dtype=np.int64)
            states = torch.stack([hidden[layer][place.offset : place.offset + place.length] for layer in slots], 1)
            save_file(
                {"hidden_states": states.contiguous(), "token_ids": torch.from_numpy(ids)},  # (T, n, H), (T,)
                str(hs_dir / f"hs_{len(columns['seq_len'])}.safetensors"),
            )
            columns["input_ids"].append(ids.tolist())
            columns["loss_mask"].append(np.asarray(mask[: place.length], dtype=np.int64).tolist())
            columns["seq_len"].append(int(place.length))
    return columns


def write_dataset(out: Path, columns: Dict[str, list], python: Path) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
        json.dump(columns, spec)
        spec.flush()
        run = subprocess.run(
            [str(python), "-c", SAVE_DATASET, spec.name, str(out)],
            env=speculators_env(),
            capture_output=True,
            text=True,
        )
    if run.returncode != 0:
        raise SystemExit(f"datasets.save_to_disk in {python} failed:\n{run.stderr[-3000:]}")


def write_vocab(out: Path, counts: np.ndarray, draft_vocab_size: int) -> None:
    from specdraft.drafts.eagle3.vocab import vocab_maps

    d2t, t2d = vocab_maps(counts, draft_vocab_size)
    np.save(out / f"d2t-{draft_vocab_size}.npy", d2t.numpy())  # (N,) int64
    np.save(out / f"t2d-{draft_vocab_size}.npy", t2d.numpy())  # (V,) bool
    seen = np.flatnonzero(counts)
    torch.save({int(i): int(counts[i]) for i in seen}, out / "token_freq.pt")


def write_features(
    out: Path,
    cfg,
    layers: Sequence[int],
    draft_vocab_size: Optional[int] = None,
    val_rows: int = 1,
    dtype: str = "float32",
    python: Optional[Path] = None,
    log=print,
) -> dict:
    """OUT in speculators' layout (the module docstring) -> versus.json's contents."""
    from specdraft.drafts.eagle3.layer import DEFAULT_DRAFT_VOCAB
    from specdraft.drafts.eagle3.vocab import count_target_tokens
    from specdraft.target.checks import load_target_config
    from specdraft.target.model import load_target_tokenizer
    from specdraft.train.data import prepare_data
    from specdraft.train.engine import init_distributed

    python = Path(python or speculators_python())
    if not python.is_file():
        raise SystemExit(f"no speculators venv at {python} (make speculators-venv, or set {PYTHON_VAR})")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out}: exists and is not empty")
    init_distributed()  # prepare_data's collectives: a world of one
    text = load_target_config(cfg.target).get_text_config()
    num_layers, vocab_size = text.num_hidden_layers, text.vocab_size
    if any(not 0 <= layer <= num_layers for layer in layers):
        raise SystemExit(f"--layers {list(layers)}: ids are 0..{num_layers} on this {num_layers}-layer target")
    slots = [*layers, num_layers]  # the last slot: the verifier's last state, before the final norm
    data = prepare_data(cfg, load_target_tokenizer(cfg.target), 0, log)

    (out / HIDDEN_STATES).mkdir(parents=True)
    columns = write_rows(out / HIDDEN_STATES, data, window_features(cfg, data, slots, DTYPES[dtype]), slots)
    rows = len(columns["seq_len"])
    for k in range(min(val_rows, rows)):  # held out by speculators: copies, so every row trains
        (out / HIDDEN_STATES / f"hs_{rows + k}.safetensors").hardlink_to(out / HIDDEN_STATES / f"hs_{k}.safetensors")
        for name in columns:
            columns[name].append(columns[name][k])
    write_dataset(out, columns, python)

    draft_vocab_size = draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab_size)  # specdraft's default
    write_vocab(out, count_target_tokens(data, vocab_size), draft_vocab_size)
    total = len(columns["seq_len"])
    summary = {
        "rows": rows,
        "val_rows": total - rows,
        "train_data_ratio": (rows + 0.5) / total if total > rows else None,
        "tokens": int(sum(columns["seq_len"][:rows])),
        "loss_tokens": int(sum(sum(m) for m in columns["loss_mask"][:rows])),
        "layers": list(layers),
        "slots": slots,
        "dtype": dtype,
        "draft_vocab_size": draft_vocab_size,
        "source": cfg.feature_cache or "live",
        "target": str(cfg.target),
    }
    (out / "versus.json").write_text(json.dumps(summary, indent=1))
    log(
        f"versus features: {rows} rows ({summary['tokens']} tokens) + {summary['val_rows']} validation copies, "
        f"slots {slots}, from {summary['source']}, draft vocab {draft_vocab_size} -> {out}"
    )
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="speculators' --data-path to write (new or empty)")
    parser.add_argument("--layers", required=True, help="the draft's layer ids, vLLM's numbering (e.g. 2,14,25)")
    parser.add_argument("--config", default=None, help="specdraft run config (YAML) the key=value pairs override")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="d2t/t2d size (default: specdraft's)")
    parser.add_argument("--val-rows", type=int, default=1, help="copies appended for speculators' hold-out")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="hidden_states dtype on disk")
    parser.add_argument("overrides", nargs="*", help="specdraft config key=value (target=, data_files=, ...)")
    args = parser.parse_intermixed_args(argv)
    from specdraft.errors import SpecdraftError

    try:
        cfg = run_config(args.config, args.overrides)
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
        write_features(args.out, cfg, layers, args.draft_vocab_size, args.val_rows, args.dtype)
    except SpecdraftError as err:
        raise SystemExit(f"versus_features: {err}") from None


if __name__ == "__main__":
    main()
