"""SpecForge's offline cache (scripts/prepare_hidden_states.py), read for features/imports.py.

Cited from sgl-project/SpecForge a6b6b02:
- scripts/prepare_hidden_states.py:541-543, 593-594: DIR/rows_{g}-{g+2000}/data_{i}.ckpt, :418 or
  .ckpt.gz (--compress), :475-480 one torch.save dict per row; :709-726 input_ids and loss_mask [T],
  the captured states unsqueezed to [1, T, ...].
- Which keys a row holds is its algorithm's OfflineCaptureLayout (specforge/algorithms/common/
  providers.py:408-480; input_ids and loss_mask always):
    EAGLE-3 (prepare_hidden_states.py:402-410, the default)  aux_hidden_state [1, T, n*H]  hidden_state [1, T, H]
    DFlash  (algorithms/dflash/providers.py:200-206)         hidden_states [1, T, n*H]     (none)
    DSpark  (algorithms/dspark/providers.py:175-181)         hidden_states [1, T, n*H]     target_last_hidden_states [1, T, H]
  The n*H columns are the captured layers in their order, concatenated; the last state is what
  SGLang's logits processor receives, after the final norm (offline_capture/sglang_backend/utils.py:
  last_hidden_states=pruned_states).
- A SpecForge layer id k is captured by SGLang as layers_to_capture k + 1 (SGLang's models,
  set_eagle3_layers_to_capture / set_dflash_layers_to_capture: "[val + 1 for val in layer_ids]"): the
  input of layer k + 1, vLLM id k + 1 (features/imports.py vllm_layer_ids).

SpecForge unpickles these with weights_only=False; here a file is loaded with weights_only=True,
and one that needs more (arbitrary objects) is refused, since unpickling it could run any code.
Rows carry their own token ids, so the files are read in any order.
"""

from __future__ import annotations

import gzip
import io
import pickle
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.features.imports import ForeignRow

ROW_FILE = re.compile(r"data_(\d+)\.ckpt(\.gz)?$")


def row_files(source_dir: Path) -> list:
    files = [p for p in source_dir.glob("rows_*/data_*.ckpt*") if ROW_FILE.search(p.name)]
    if not files:
        raise SpecdraftError(f"{source_dir}: no rows_*/data_*.ckpt files (SpecForge's prepare_hidden_states.py output)")
    return sorted(files, key=lambda p: int(ROW_FILE.search(p.name).group(1)))


def load_row(path: Path) -> dict:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    try:
        row = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecdraftError(
            f"{path}: needs more than tensors to load (weights_only refused it: {reason}); not unpickled, since "
            f"that could run any code: re-save it with plain tensors"
        ) from None
    except (OSError, RuntimeError, EOFError) as err:
        raise SpecdraftError(f"{path}: not a torch.save file ({err})") from None
    if not isinstance(row, dict):
        raise SpecdraftError(f"{path}: holds a {type(row).__name__}, not SpecForge's dict of tensors")
    return row


# (concatenated layers, last state after the final norm or None): the keys of each algorithm's layout
LAYOUTS = {
    "SpecForge EAGLE-3": ("aux_hidden_state", "hidden_state"),
    "SpecForge DSpark": ("hidden_states", "target_last_hidden_states"),
    "SpecForge DFlash": ("hidden_states", None),
}


def row_layout(path: Path, row: dict):
    """The layout whose keys this row holds (DSpark before DFlash: it is DFlash's keys and one more)."""
    for name, (layers_key, final_key) in LAYOUTS.items():
        if isinstance(row.get(layers_key), torch.Tensor) and (
            final_key is None or isinstance(row.get(final_key), torch.Tensor)
        ):
            return layers_key, final_key
    expected = " or ".join(f"{name}: {'+'.join(k for k in keys if k)}" for name, keys in LAYOUTS.items())
    raise SpecdraftError(f"{path}: none of SpecForge's layouts ({expected}); it has {', '.join(map(str, row))}")


def specforge_rows(source_dir: Path, vllm_ids: Sequence[int]) -> Iterator[ForeignRow]:
    for path in row_files(source_dir):
        row = load_row(path)
        if not isinstance(row.get("input_ids"), torch.Tensor):
            raise SpecdraftError(f"{path}: no tensor 'input_ids' (it has {', '.join(map(str, row))})")
        layers_key, final_key = row_layout(path, row)
        token_ids = row["input_ids"].reshape(-1).numpy().astype(np.int64)
        layers = row[layers_key].reshape(-1, row[layers_key].shape[-1])
        final = None if final_key is None else row[final_key].reshape(-1, row[final_key].shape[-1])
        if layers.shape[-1] % len(vllm_ids):
            raise SpecdraftError(
                f"{path}: {layers_key} is {layers.shape[-1]} wide, not a multiple of the {len(vllm_ids)} layers "
                f"of --layer-ids"
            )
        width = layers.shape[-1] // len(vllm_ids)
        if final is not None and final.shape[-1] != width:
            raise SpecdraftError(
                f"{path}: {layers_key} is {layers.shape[-1]} wide, {len(vllm_ids)} layers (--layer-ids) of "
                f"{final_key}'s {final.shape[-1]} make {final.shape[-1] * len(vllm_ids)}"
            )
        lengths = [layers.shape[0]] + ([] if final is None else [final.shape[0]])
        if any(length != len(token_ids) for length in lengths):
            raise SpecdraftError(
                f"{path}: {len(token_ids)} input_ids but features of "
                f"{' / '.join(map(str, lengths))} tokens ({layers_key}{'' if final is None else ' / ' + final_key})"
            )
        hidden = {layer: layers[:, slot * width : (slot + 1) * width] for slot, layer in enumerate(vllm_ids)}
        yield ForeignRow(path=path, token_ids=token_ids, hidden=hidden, final_hidden=final)
