"""The objective a draft trains on, as the config names it (`draft.loss`, `draft.distill_temperature`,
`draft.distill_tokens`): parsed and checked without torch, so the configuration loads without it.
The objectives themselves (chunked over rows) are objectives.py's."""

# (no `from __future__ import annotations`: ObjectiveOptions' field types must be real types, the
# `draft:` config schema is assembled from them in another module)
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence, Tuple

from specdraft.errors import SpecdraftError

if TYPE_CHECKING:
    import torch

OBJECTIVES = ("ce", "soft_ce", "kl", "tv", "lk_alpha", "lk_lambda")
TEACHER_OBJECTIVES = ("soft_ce", "kl", "tv", "lk_alpha", "lk_lambda")  # the ones that read the target's distribution
LK_OBJECTIVES = ("lk_alpha", "lk_lambda")  # SpecForge's LK losses: EAGLE-3 and P-EAGLE (Draft.lk_loss)
DISTILL_TOKENS = ("answers", "all")  # draft.distill_tokens: where the teacher terms learn
_TERM = re.compile(r"^\s*(?:([^*]+?)\s*\*\s*)?([A-Za-z_]+)\s*$")  # "[weight *] name"


@dataclass(frozen=True)
class Objective:
    """A weighted sum of named objectives (only positive weights kept), at a temperature."""

    weights: Tuple[Tuple[str, float], ...]  # in OBJECTIVES order
    temperature: float = 1.0
    all_tokens: bool = False  # the teacher terms learn every token, not only answers (distill_tokens: all)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.weights)

    def weight(self, name: str) -> float:
        return dict(self.weights).get(name, 0.0)

    @property
    def needs_teacher(self) -> bool:
        """True when a term reads the target's distribution (its final hidden state)."""
        return any(name in TEACHER_OBJECTIVES for name in self.names)

    @property
    def needs_labels(self) -> bool:
        return "ce" in self.names

    @property
    def lk(self) -> bool:
        """True when a term is an LK loss (it reads the acceptance sum_v min(p, q))."""
        return any(name in LK_OBJECTIVES for name in self.names)

    def __str__(self) -> str:
        body = " + ".join(name if w == 1.0 else f"{w:g}*{name}" for name, w in self.weights)
        if not self.needs_teacher:
            return body
        return f"{body} (T={self.temperature:g}{', all tokens' if self.all_tokens else ''})"

    def taught(self, loss_mask: "torch.Tensor", token_mask: Optional["torch.Tensor"] = None) -> "torch.Tensor":
        """The tokens a loss predicts, a mask like loss_mask (the answer tokens): every token when
        the teacher terms learn all of them, but never a window's padding (token_mask 0)."""
        if not self.all_tokens:
            return loss_mask
        return loss_mask.new_ones(loss_mask.shape) if token_mask is None else token_mask.to(loss_mask.dtype)

    def over_rows(self, rows: int, answers: int) -> "Objective":
        """This objective for a loss of `rows` counted rows, `answers` of them with a CE label, that
        divides its weighted sum by `rows`: CE's weight times rows / answers, so that CE stays the
        mean over the answer rows and each teacher term the mean over all rows."""
        if answers in (0, rows) or "ce" not in self.names:
            return self
        scale = rows / answers
        return replace(self, weights=tuple((name, w * scale if name == "ce" else w) for name, w in self.weights))


CE = Objective((("ce", 1.0),))


@dataclass
class ObjectiveOptions:
    """The `draft.` keys of the objective, shared by every family (its options inherit these)."""

    # ce | soft_ce | kl | tv, a weighted sum '0.9*tv + 0.1*ce' or a mapping {tv: 0.9, ce: 0.1}
    # (a 0 weight drops a term); null: the family's default (GLIDE: ce); eagle3 / peagle also
    # lk_alpha | lk_lambda (SpecForge's LK losses, temperature 1)
    loss: Any = None
    distill_temperature: float = 1.0  # soft_ce / kl / tv compare softmax(logits / T) of target and draft
    # answers | all: the tokens soft_ce / kl / tv learn; all: prompt and template tokens too (ce
    # learns answers either way)
    distill_tokens: str = "answers"


def validate_objective_options(draft_cfg, source: str, default: str = "ce", lk_family: bool = True) -> None:
    """One-line SpecdraftError for a bad draft.loss / distill_temperature / distill_tokens
    (`default`: the family's objective when draft.loss is null; lk_family: the family trains the
    LK losses, EAGLE-3 and P-EAGLE)."""
    temperature = draft_cfg.get("distill_temperature", 1.0)
    if not temperature > 0:
        raise SpecdraftError(f"{source}: key 'draft.distill_temperature': must be > 0, got {temperature}")
    tokens = draft_cfg.get("distill_tokens", "answers")
    if tokens not in DISTILL_TOKENS:
        raise SpecdraftError(
            f"{source}: key 'draft.distill_tokens': must be one of {', '.join(DISTILL_TOKENS)}, got {tokens!r}"
        )
    objective = objective_from_options(draft_cfg, default, where=f"{source}: key 'draft.loss'")
    if objective.lk and not lk_family:
        lk = ", ".join(name for name in objective.names if name in LK_OBJECTIVES)
        raise SpecdraftError(
            f"{source}: key 'draft.loss': {lk} is an LK loss, trained by draft.type "
            f"eagle3 and peagle only, not {draft_cfg.get('type')!r}"
        )
    if tokens == "all" and not objective.all_tokens:  # no teacher term to learn the other tokens
        raise SpecdraftError(
            f"{source}: key 'draft.distill_tokens': 'all' needs a teacher term in "
            f"draft.loss ({', '.join(TEACHER_OBJECTIVES)}); {objective} learns answers only"
        )


def objective_from_options(draft_cfg, default: str, where: str = "key 'draft.loss'") -> Objective:
    """The objective a family trains on: draft.loss, or the family's `default` when it is null."""
    spec = draft_cfg.get("loss")
    objective = parse_objective(default if spec is None else spec, draft_cfg.get("distill_temperature", 1.0), where)
    if draft_cfg.get("distill_tokens", "answers") == "all" and objective.needs_teacher:
        objective = replace(objective, all_tokens=True)
    return objective


def parse_objective(spec: Any, temperature: float = 1.0, where: str = "key 'draft.loss'") -> Objective:
    """'tv', '0.9*tv + 0.1*ce' or a mapping {name: weight} -> Objective; one-line SpecdraftError.

    A zero weight drops a term (so `draft.loss.ce=0` removes CE from a mapping given in YAML).
    """
    if isinstance(spec, str):
        pairs = []
        for term in spec.split("+"):
            match = _TERM.match(term)
            if match is None:
                raise SpecdraftError(
                    f"{where}: cannot read {term.strip()!r} in {spec!r} (expected e.g. 'tv' or '0.9*tv + 0.1*ce')"
                )
            pairs.append((match.group(2), 1.0 if match.group(1) is None else match.group(1)))
    elif isinstance(spec, Mapping):
        pairs = [(str(name), weight) for name, weight in spec.items()]
    else:
        raise SpecdraftError(
            f"{where}: expected an objective name, a sum like '0.9*tv + 0.1*ce' "
            f"or a mapping of weights, got {_kind(spec)}"
        )
    weights: Dict[str, float] = {}
    for name, weight in pairs:
        if name not in OBJECTIVES:
            raise SpecdraftError(f"{where}: unknown objective {name!r} (choose from {', '.join(OBJECTIVES)})")
        if name in weights:
            raise SpecdraftError(f"{where}: objective {name!r} given twice")
        weights[name] = _weight(name, weight, where)
    if not any(w > 0 for w in weights.values()):
        raise SpecdraftError(f"{where}: no objective has a positive weight")
    if all(weights.get(name, 0.0) > 0 for name in LK_OBJECTIVES):
        raise SpecdraftError(f"{where}: lk_alpha and lk_lambda are two modes of one loss; choose one")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise SpecdraftError(f"temperature of {where}: must be a number > 0, got {temperature!r}")
    if any(weights.get(name, 0.0) > 0 for name in LK_OBJECTIVES) and temperature != 1.0:
        raise SpecdraftError(
            f"{where}: the LK losses compare the target's and the draft's sampling distributions "
            f"at temperature 1; draft.distill_temperature is {temperature:g}"
        )
    return Objective(
        tuple((name, weights[name]) for name in OBJECTIVES if weights.get(name, 0.0) > 0), float(temperature)
    )


def _kind(value: Any) -> str:
    return "a list" if isinstance(value, Sequence) or type(value).__name__ == "ListConfig" else type(value).__name__


def _weight(name: str, value: Any, where: str) -> float:
    try:
        weight = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        weight = math.nan
    if not math.isfinite(weight):
        raise SpecdraftError(f"{where}: weight of {name!r} must be a number, got {value!r}")
    if weight < 0:
        raise SpecdraftError(f"{where}: weight of {name!r} must be >= 0, got {weight:g}")
    return weight
