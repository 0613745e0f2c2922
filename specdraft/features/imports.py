"""`specdraft capture CONFIG --from speculators|specforge --source DIR --layer-ids ...`: another
trainer's feature cache converted into a specdraft one (same manifest and shards, written with
CacheWriter), so offline training reads it as it reads its own capture.

A foreign row is matched to one of this config's rows (the conversations of the training data,
tokenised by our template) by its token ids, both cut to capture_length: the foreign trainer's
order, file names and loss masks play no part (features do not depend on the loss mask). Only the
kinds this run's drafts read are written; layer ids are the ones the user gave the other trainer
(readers in imports_speculators.py / imports_specforge.py turn them into vLLM ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

from specdraft.errors import SpecdraftError

SOURCES = ("speculators", "specforge")
IMPORT_RECORD = "imported.json"  # what was imported from where (the manifest says what each kind is)


@dataclass
class ForeignRow:
    path: Path  # the file its features came from (named in every refusal)
    token_ids: np.ndarray  # (T,) int64
    hidden: Dict[int, torch.Tensor] = field(default_factory=dict)  # vLLM id -> (T, H)
    final_hidden: Optional[torch.Tensor] = None  # (T, H) after the final norm


@dataclass
class ImportReport:
    foreign_rows: int = 0
    written: int = 0  # our rows written (one foreign row can serve several of ours: same ids)
    already: int = 0  # our rows the cache held before
    unmatched: int = 0  # foreign rows whose ids are none of ours
    unserved: int = 0  # our rows no foreign row matched
    first_unmatched: Optional[str] = None


def parse_layer_ids(text: Optional[str]) -> List[int]:
    if not text:
        raise SpecdraftError(
            "--layer-ids: required with --from (the layer ids the other trainer captured, e.g. 2,16,29,32)"
        )
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SpecdraftError(f"--layer-ids {text!r}: not a comma-separated list of integers") from None
    if len(set(ids)) != len(ids):
        raise SpecdraftError(f"--layer-ids {text!r}: an id appears twice")
    return ids


def vllm_layer_ids(source: str, layer_ids: Sequence[int], num_layers: int) -> List[int]:
    """The user's ids (the other trainer's numbering) as vLLM ids: speculators uses vLLM's; SpecForge's
    id k is the output of decoder layer k, the input of layer k + 1."""
    shift = {"speculators": 0, "specforge": 1}[source]
    top = num_layers - shift
    for layer in layer_ids:
        if not 0 <= layer <= top:
            raise SpecdraftError(
                f"--layer-ids: {layer} is no {source} layer id of this {num_layers}-layer target (0..{top})"
            )
    return [layer + shift for layer in layer_ids]


def foreign_rows(source: str, source_dir: Path, vllm_ids: Sequence[int]) -> Iterator[ForeignRow]:
    if source == "speculators":
        from specdraft.features.imports_speculators import speculators_rows

        return speculators_rows(source_dir, vllm_ids)
    from specdraft.features.imports_specforge import specforge_rows

    return specforge_rows(source_dir, vllm_ids)


class FinalNorm:
    """The target's final norm, built by transformers' class of the target at 0 layers (as
    target/light.py does) with its weights read from the checkpoint: what turns vLLM id L (the
    last layer's output) into what lm_head reads, for a cache that stores only the former."""

    def __init__(self, target_dir: str):
        import copy

        from transformers import AutoModelForCausalLM

        from specdraft.target.checks import load_target_config
        from specdraft.target.weights import load_target_tensors

        shallow = copy.deepcopy(load_target_config(target_dir))
        text = shallow.get_text_config()
        text.num_hidden_layers = 0
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = []
        model = AutoModelForCausalLM.from_config(shallow, dtype=torch.float32)
        name = next(n for n, _ in model.named_modules() if n.endswith(".norm") and n.count(".") <= 2)
        self.norm = model.get_submodule(name)
        tensors = load_target_tensors(target_dir, f"{name}.", torch.float32)
        if not tensors:
            raise SpecdraftError(
                f"{target_dir}: no {name}.* tensors in the checkpoint (the final norm to apply to layer id L)"
            )
        self.norm.load_state_dict({key[len(name) + 1 :]: value for key, value in tensors.items()})
        self.norm.eval()

    @torch.no_grad()
    def __call__(self, last: torch.Tensor) -> torch.Tensor:
        return self.norm(last.float()[None])[0]


def ids_bytes(ids) -> bytes:
    return np.ascontiguousarray(ids, dtype=np.int64).tobytes()


def row_values(
    foreign: ForeignRow, kinds, norm: Optional[FinalNorm], num_layers: int, length: int, hidden_size: int
) -> Dict[str, torch.Tensor]:
    values = {}
    for kind in kinds:
        if kind.startswith("hidden."):
            value = foreign.hidden[int(kind.split(".")[1])]
        elif foreign.final_hidden is not None:
            value = foreign.final_hidden
        elif norm is None:  # SpecForge's DFlash layout stores no last state
            raise SpecdraftError(
                f"{foreign.path}: holds no state after the final norm, which this run's drafts read (SpecForge's "
                f"EAGLE-3 and DSpark layouts store it, its DFlash layout does not)"
            )
        else:  # speculators: the last state before the norm (checked present by its reader)
            value = norm(foreign.hidden[num_layers])
        if value.shape[-1] != hidden_size or value.shape[0] < length:
            raise SpecdraftError(
                f"{foreign.path}: {kind} has shape {tuple(value.shape)}, expected ({length}+, {hidden_size})"
            )
        values[kind] = value[:length].contiguous()
    return values
