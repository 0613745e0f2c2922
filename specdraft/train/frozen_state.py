"""What DeepSpeed does not save of the draft: its untrained state (buffers such as EAGLE-3's
d2t/t2d, frozen parameters such as DFlash's mask_delta), carried in the slot's FROZEN_FILE, and a
fingerprint of its weights that proves a load brought the draft back."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List, Union

import torch

from specdraft.errors import SpecdraftError
from specdraft.run import FROZEN_FILE


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes: equal exactly when the tensors are bit for bit
    (a float sum is not: its last bits follow the reduction's thread count)."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def draft_fingerprint(weights: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """Per-tensor digest of the draft's weights. Saved with each slot and compared after a load:
    proof that the draft came back, whatever the threads, world size or ZeRO stage of either run."""
    return {name: tensor_digest(t) for name, t in weights.items()}


def _legacy_sums(weights: Dict[str, torch.Tensor]) -> Dict[str, List[float]]:
    """The fingerprint slots held before the digests: per tensor (sum, sum of squares)."""
    return {name: [float(t.double().sum()), float(t.double().pow(2).sum())] for name, t in weights.items()}


def check_fingerprint(slot_dir: Path, weights: dict, record: dict) -> None:
    saved: Dict[str, Union[str, List[float]]] = record["draft_fingerprint"]
    legacy = any(isinstance(v, list) for v in saved.values())
    if (_legacy_sums(weights) if legacy else draft_fingerprint(weights)) != saved:
        different = sorted(name for name, value in draft_fingerprint(weights).items()
                           if not legacy and saved.get(name) != value) or sorted(set(weights) ^ set(saved))
        raise SpecdraftError(f"{slot_dir}: the draft weights loaded do not match the saved ones"
                             f"{f' ({len(different)} tensors differ, e.g. {different[0]})' if different else ''}")


def frozen_state(draft, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The entries of a draft's full state dict (`weights`) that are not trained parameters."""
    trained = {name for name, param in draft.named_parameters() if param.requires_grad}
    return {name: t for name, t in weights.items() if name not in trained}


def write_frozen_state(slot_dir: Path, state: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(slot_dir / FROZEN_FILE))


def read_frozen_state(slot_dir: Path) -> Dict[str, torch.Tensor]:
    """The slot's frozen state (checked against the manifest by the caller)."""
    from safetensors.torch import load_file

    path = slot_dir / FROZEN_FILE
    if not path.is_file():
        raise SpecdraftError(f"{path}: missing (a slot saved before frozen state was carried); it cannot "
                             f"be resumed or exported")
    return load_file(str(path))


def restore_frozen_state(draft, state: Dict[str, torch.Tensor], source: str) -> None:
    """Collective under ZeRO-3: put a slot's frozen state back into the draft. The family checks
    its own extra state first (e.g. EAGLE-3's maps against those this run built)."""
    import deepspeed

    expected = frozen_state(draft, dict(draft.state_dict(keep_vars=True)))
    if set(state) != set(expected):
        raise SpecdraftError(f"{source}: its frozen draft state holds {sorted(state)}, this run's draft has "
                             f"{sorted(expected)}")
    extra = draft.extra_state()
    draft.load_extra_state({k: state[k] for k in extra}, source=source)
    params = [t for t in expected.values() if isinstance(t, torch.nn.Parameter)]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero3), torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name].to(tensor.device))
