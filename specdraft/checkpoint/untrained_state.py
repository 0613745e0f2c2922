"""What DeepSpeed does not save of the draft: its untrained state (buffers such as EAGLE-3's
d2t/t2d, frozen parameters such as DFlash's mask_delta), carried in the slot's FROZEN_FILE, and a
fingerprint of its weights that proves a load brought the draft back."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict

import torch

from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import FROZEN_FILE


FINGERPRINT_KEY = "draft_sha256"  # in COMMITTED; slots saved before it carry LEGACY_KEY
LEGACY_KEY = "draft_fingerprint"


def draft_fingerprint(weights: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """Per tensor: sha256 of its dtype, shape and bytes. Saved with each slot and compared after a
    load: proof that the draft came back bit for bit, whatever the thread count, world size or
    ZeRO stage of the saving and the loading run (a float sum's last bits depend on how many
    threads reduced it, so sums refused right resumes)."""
    return {name: tensor_sha256(t) for name, t in weights.items()}


def tensor_sha256(tensor: torch.Tensor) -> str:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha256(f"{flat.dtype}{tuple(tensor.shape)}".encode())
    digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def check_fingerprint(slot_dir: Path, weights: dict, record: dict) -> None:
    if FINGERPRINT_KEY in record:
        saved, now = record[FINGERPRINT_KEY], draft_fingerprint(weights)
        differ = sorted(set(saved) ^ set(now)) or [name for name in sorted(now) if now[name] != saved[name]]
    else:
        differ = _legacy_differences(weights, record[LEGACY_KEY])
    if differ:
        raise SpecdraftError(f"{slot_dir}: the draft weights loaded do not match the saved ones ({differ[0]} differs)")


def _legacy_differences(weights: Dict[str, torch.Tensor], saved: Dict[str, list]) -> list:
    """Slots saved before the sha256s carry (sum, sum of squares) per tensor, whose last bits
    depend on the summing thread count: equal within twice the rounding bound of a sum of n
    doubles in any order, n * eps * sum(|x|) (and sum(x^2) for the squares)."""
    if set(saved) != set(weights):
        return sorted(set(saved) ^ set(weights))
    differ = []
    for name, tensor in sorted(weights.items()):
        x = tensor.double()
        now, bounds = (x.sum(), x.pow(2).sum()), (x.abs().sum(), x.pow(2).sum())
        slack = 2 * x.numel() * torch.finfo(torch.float64).eps
        if any(abs(float(a) - b) > slack * float(bound) for a, b, bound in zip(now, saved[name], bounds)):
            differ.append(name)
    return differ


def untrained_state(draft, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The entries of a draft's full state dict (`weights`) that are not trained parameters."""
    trained = {name for name, param in draft.named_parameters() if param.requires_grad}
    return {name: t for name, t in weights.items() if name not in trained}


def write_untrained_state(slot_dir: Path, state: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(slot_dir / FROZEN_FILE))


def read_untrained_state(slot_dir: Path) -> Dict[str, torch.Tensor]:
    """The slot's untrained state (checked against the manifest by the caller)."""
    from safetensors.torch import load_file

    path = slot_dir / FROZEN_FILE
    if not path.is_file():
        raise SpecdraftError(
            f"{path}: missing (a slot saved before frozen state was carried); it cannot be resumed or exported"
        )
    return load_file(str(path))


def restore_untrained_state(draft, state: Dict[str, torch.Tensor], source: str) -> None:
    """Collective under ZeRO-3: put a slot's untrained state back into the draft. The family checks
    its own extra state first (e.g. EAGLE-3's maps against those this run built)."""
    import deepspeed

    expected = untrained_state(draft, dict(draft.state_dict(keep_vars=True)))
    if set(state) != set(expected):
        raise SpecdraftError(
            f"{source}: its frozen draft state holds {sorted(state)}, this run's draft has {sorted(expected)}"
        )
    extra = draft.extra_state()
    draft.load_extra_state({k: state[k] for k in extra}, source=source)
    params = [t for t in expected.values() if isinstance(t, torch.nn.Parameter)]
    zero3 = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=zero3), torch.no_grad():
        for name, tensor in expected.items():
            tensor.copy_(state[name].to(tensor.device))
