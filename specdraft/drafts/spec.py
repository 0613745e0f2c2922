"""What the configuration knows of a draft family without building one: no torch, no transformers.

Each family declares it in drafts/<family>/options.py, a subclass of DraftSpec: its name, its
`options` dataclass of `draft.` keys, its default objective, what it refuses, the names of its
serving formats, and the checks of its keys (validate_config). Its Draft subclass (model.py)
inherits that class, so the config (`specdraft config`, drafts.SPECS) and the trainer
(drafts.registry.FAMILIES) read the same declarations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, NoReturn, Optional, Tuple

from specdraft.errors import SpecdraftError


class DraftSpec:
    family: ClassVar[str] = ""  # the `draft.type` value
    label: ClassVar[str] = ""  # the family's name in tables and logs (EAGLE-3)
    # the one family whose folder this family's folder may import (P-EAGLE builds on EAGLE-3's layer)
    base_family: ClassVar[Optional[str]] = None
    options: ClassVar[type]  # dataclass of this family's `draft.` keys (flat, with defaults)
    default_loss: ClassVar[str] = "ce"  # the objective when draft.loss is null
    lk_loss: ClassVar[bool] = False  # trains draft.loss: lk_alpha | lk_lambda (a head over a draft vocab)
    # training_loss reads features.shard: it trains on a sequence shard (sequence_parallel_size > 1)
    sequence_parallel: ClassVar[bool] = False
    # a family that cannot: why, after "draft.type X" in the config's refusal ("": not yet)
    sequence_parallel_refusal: ClassVar[str] = ""
    # the names of Draft.serving_formats (their writers live with the model): what export_formats takes
    serving_format_names: ClassVar[Tuple[str, ...]] = ()

    @classmethod
    def validate_config(cls, draft_cfg, target_config: Optional[Any], source: str, max_seq_length: int) -> None:
        """Raise a one-line SpecdraftError naming the bad `draft.` key. target_config is None when
        the target directory has no readable config yet (checked again at training start)."""

    @classmethod
    def sequence_parallel_reach(cls, draft_cfg) -> Optional[Tuple[str, int]]:
        """(draft key, n): under SP a rank reads the next rank's first n tokens (SequenceShard.
        extend_right), so n must not exceed a shard; None: no such key."""
        return None

    @classmethod
    def moves_target_positions(cls, draft_cfg) -> bool:
        """Whether sample_batch_options gives the target other positions than the data's (a
        "position_ids" entry): such a draft cannot share a target pass with other drafts."""
        return False

    @classmethod
    def identity_options(cls, options: Dict[str, Any], target_config: Optional[Any]) -> Dict[str, Any]:
        """The family's `draft.` keys as they identify a checkpoint (config_hash): a family resolves
        here a default that depends on the target, or drops a key added later at the value that
        checkpoints written before it had in effect (so those still resume)."""
        return options


def option_failure(source: str) -> Callable[[str, str], NoReturn]:
    """fail(key, why) for a family's checks of its `draft.` keys: one line naming the file and key."""

    def fail(key: str, why: str) -> NoReturn:
        raise SpecdraftError(f"{source}: key 'draft.{key}': {why}")

    return fail


def target_text_config(target_config):
    """The decoder's config, as transformers finds it: the `text_config` of a multimodal target
    (Gemma 3), else the config itself. The one lookup for config objects (target/weights.py reads
    config.json as a dict, without transformers)."""
    return target_config.get_text_config()


@dataclass
class LayerDims:
    """The shape of one Llama-style decoder layer: the first fields of every family's dims."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
