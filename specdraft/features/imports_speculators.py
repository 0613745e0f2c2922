"""speculators 0.9.0's offline cache, read for features/imports.py.

    DIR/                         the Arrow dataset its trainer loads with datasets.load_from_disk
      state.json                 (speculators/train/data.py:164) `_data_files`: the Arrow files in
      data-00000-of-0000N.arrow  order (datasets/arrow_dataset.py:1868), each an Arrow IPC stream
      dataset_info.json          (datasets/arrow_writer.py:628); columns input_ids, loss_mask, seq_len
      hidden_states/hs_{i}.safetensors   row i's features (data.py:184, hs_connectors FileTransfer)
        hidden_states [T, n_layers, H]   one slot per --layer-ids entry, in that order
        token_ids [T] int64              must equal the row's input_ids (data.py:314)
        hidden_states_scales [T, 1, 1]   fp8 files only: float32, one per token (hs_connectors.fp8_utils)

The Arrow files are read with pyarrow (what `datasets` reads them with) so specdraft needs no
`datasets`; the hs files through hs_connectors' FP8Transfer, which passes plain files through and
dequantises fp8 ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, List, Sequence

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.features.imports import ForeignRow

HIDDEN_STATES_DIR = "hidden_states"


def read_dataset_rows(dataset_dir: Path) -> List[np.ndarray]:
    """Each row's input_ids, in the dataset's order (the hs file index)."""
    import pyarrow as pa

    state_path = dataset_dir / "state.json"
    try:
        files = [entry["filename"] for entry in json.loads(state_path.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SpecdraftError(f"{state_path}: not the state.json of a dataset saved with save_to_disk ({err})") from None
    rows: List[np.ndarray] = []
    for name in files:
        path = dataset_dir / name
        try:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as err:
            raise SpecdraftError(f"{path}: not an Arrow stream file ({err})") from None
        if "input_ids" not in table.column_names:
            raise SpecdraftError(f"{path}: no column input_ids (it has {', '.join(table.column_names)})")
        rows += [np.asarray(ids, dtype=np.int64) for ids in table.column("input_ids").to_pylist()]
    return rows


def hidden_states_dir(source_dir: Path) -> Path:
    """DIR/hidden_states (the trainer's default), or DIR itself when it holds the hs files."""
    inner = source_dir / HIDDEN_STATES_DIR
    return inner if inner.is_dir() else source_dir


def speculators_rows(source_dir: Path, vllm_ids: Sequence[int]) -> Iterator[ForeignRow]:
    from hs_connectors.transfer import FP8Transfer

    dataset_rows = read_dataset_rows(source_dir)
    hs_dir = hidden_states_dir(source_dir)
    transfer = FP8Transfer(hs_dir, dequantize_dtype=torch.float32)
    for index, input_ids in enumerate(dataset_rows):
        path = hs_dir / f"hs_{index}.safetensors"
        try:
            sample = transfer.get_cached(index)
        except Exception as err:  # safetensors' own errors: a header or payload it cannot read
            raise SpecdraftError(f"{path}: not a readable safetensors file ({err})") from None
        if sample is None:
            continue  # no features for this row (speculators trains with --on-missing skip): unserved
        for name in ("hidden_states", "token_ids"):
            if name not in sample:
                raise SpecdraftError(f"{path}: no tensor {name!r} (it has {', '.join(sample)})")
        token_ids = sample["token_ids"].numpy().astype(np.int64)
        if not np.array_equal(token_ids, input_ids):
            raise SpecdraftError(
                f"{path}: its token_ids ({len(token_ids)}) differ from row {index}'s input_ids ({len(input_ids)}) "
                f"of {source_dir}: features of another conversation; nothing more was imported"
            )
        states = sample["hidden_states"]
        if states.dim() != 3 or states.shape[1] != len(vllm_ids) or states.shape[0] != len(token_ids):
            raise SpecdraftError(
                f"{path}: hidden_states has shape {tuple(states.shape)}, expected ({len(token_ids)}, "
                f"{len(vllm_ids)}, H): one slot per --layer-ids entry"
            )
        hidden = {layer: states[:, slot] for slot, layer in enumerate(vllm_ids)}
        yield ForeignRow(path=path, token_ids=token_ids, hidden=hidden)
