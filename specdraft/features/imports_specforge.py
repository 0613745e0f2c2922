"""SpecForge's offline cache (scripts/prepare_hidden_states.py), read for features/imports.py.

    DIR/rows_{g}-{g+2000}/data_{i}.ckpt (or .ckpt.gz)   one torch.save dict per row (EAGLE-3):
      input_ids        [T] (or [1, T])
      loss_mask        [T] (or [1, T])
      aux_hidden_state [1, T, n*H]   the outputs of SpecForge layers k (vLLM id k + 1), concatenated
      hidden_state     [1, T, H]     after the final norm: what lm_head reads

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


def specforge_rows(source_dir: Path, vllm_ids: Sequence[int]) -> Iterator[ForeignRow]:
    for path in row_files(source_dir):
        row = load_row(path)
        for name in ("input_ids", "aux_hidden_state", "hidden_state"):
            if not isinstance(row.get(name), torch.Tensor):
                raise SpecdraftError(f"{path}: no tensor {name!r} (it has {', '.join(map(str, row))})")
        token_ids = row["input_ids"].reshape(-1).numpy().astype(np.int64)
        final = row["hidden_state"].reshape(-1, row["hidden_state"].shape[-1])
        aux = row["aux_hidden_state"].reshape(-1, row["aux_hidden_state"].shape[-1])
        width = final.shape[-1]
        if aux.shape[0] != len(token_ids) or final.shape[0] != len(token_ids):
            raise SpecdraftError(
                f"{path}: {len(token_ids)} input_ids but features of {aux.shape[0]} / {final.shape[0]} tokens "
                f"(aux_hidden_state / hidden_state)"
            )
        if aux.shape[-1] != width * len(vllm_ids):
            raise SpecdraftError(
                f"{path}: aux_hidden_state is {aux.shape[-1]} wide, {len(vllm_ids)} layers (--layer-ids) of "
                f"{width} make {width * len(vllm_ids)}"
            )
        hidden = {layer: aux[:, slot * width : (slot + 1) * width] for slot, layer in enumerate(vllm_ids)}
        yield ForeignRow(path=path, token_ids=token_ids, hidden=hidden, final_hidden=final)
