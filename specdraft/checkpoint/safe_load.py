"""Reading a checkpoint's pickles without running code: a slot someone shared is data, not a program.

A .pt file is a pickle, and a pickle can call anything while it loads. DeepSpeed unpickles its
files with weights_only=False (its checkpoint engine, the universal conversion and loader,
zero_to_fp32), so:
- every .pt file is unpickled once with torch's weights_only unpickler, allowing exactly the
  DeepSpeed types our slots hold, when slots.verify_files checks it against the manifest: before
  anything else reads it, on every rank that will;
- the engine's own loads go through load() (load_weights_only).
A pickle that needs anything else is refused in one line, and nothing of it runs.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError


def allowed_globals() -> list:
    """What a slot's pickles hold besides tensors and plain containers (found by loading a slot of
    every family at ZeRO 0-3, fp32 and bf16, 1 and 2 ranks, and its universal copy): the ZeRO
    optimizer's loss scaler, stage and parameter fragment addresses."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    # Python 3.11.0-3.11.4 pickle an int Enum member as getattr(ZeroStageEnum, "gradients") (later
    # ones call the class). weights_only still refuses to call whatever getattr returns.
    return [LossScaler, ZeroStageEnum, fragment_address, getattr]


def load(path, map_location=None, mmap: bool = False):
    """torch.load with weights_only=True and our allowlist; a refused pickle is a SpecdraftError."""
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError:
        raise
    except Exception as err:  # whatever a foreign pickle trips on: one line, nothing of it run
        held = ", ".join(g.__qualname__ for g in allowed_globals() if g is not getattr)
        raise SpecdraftError(
            f"{path}: refusing to load it: its pickle {_wants(err)} (a specdraft checkpoint "
            f"holds tensors and DeepSpeed's {held} only; unpickling more could run code)"
        ) from None


def check(path: Path) -> None:
    """Unpickle `path` with the allowlist and drop it (its tensors memory-mapped, not read)."""
    load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))


def _wants(err: Exception) -> str:
    """torch's multi-paragraph refusal -> what the pickle asked for, in a few words."""
    if not isinstance(err, pickle.UnpicklingError):
        return f"fails to load ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    text = str(err)
    wanted = re.search(r"GLOBAL ([\w.]+)", text)
    if wanted:
        return f"calls {wanted.group(1)}"
    reason = text.split("WeightsUnpickler error:")[1] if "WeightsUnpickler error:" in text else text.split("\n", 1)[-1]
    lines = [line.strip() for line in reason.splitlines() if line.strip() and not line.startswith("Check the doc")]
    return f"is refused by torch's weights_only unpickler ({lines[0] if lines else 'no reason given'})"


def load_weights_only(engine) -> None:
    """DeepSpeed's checkpoint engine unpickles with weights_only=False: `engine` loads through load()."""
    engine.checkpoint_engine.load = lambda path, map_location=None: load(path, map_location=map_location)
