"""Measuring a drafter against plain target decoding on the same prompts: tau, acceptance per
position, TV and speedup (the numbers of `specdraft eval`, the benchmarks and training's evals).
Drafts arrive as objects with `make_drafter(target)`; this module never imports a family."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from specdraft.decode.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specdraft.decode.prompts import encode_messages, stop_tokens
from specdraft.decode.report import acceptance_stats, timing_stats
from specdraft.decode.speculative import Generation, generate_plain, speculative_generate
from specdraft.errors import SpecdraftError

METHODS = ("draft", "untrained", "prompt_lookup", "self")
NEEDS_DRAFT = ("draft", "untrained")
log = logging.getLogger(__name__)


def make_drafter(method: str, target: nn.Module, draft: Optional[nn.Module] = None) -> Drafter:
    """The drafter of a method; a draft (any family) brings its own."""
    if method in NEEDS_DRAFT:
        if draft is None:
            raise SpecdraftError(f"method {method!r} needs a draft export")
        return draft.make_drafter(target)
    if method == "prompt_lookup":
        return PromptLookupDrafter()
    if method == "self":
        return ModelDrafter(target, name="self")
    raise SpecdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


# progress(what, prompts) -> a bar with update(n) and close(): `specdraft eval` passes tqdm's
Progress = Callable[[str, int], Any]


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _each(prompts: Sequence[Sequence[int]], progress: Optional[Progress], what: str):
    """The prompts, one at a time, the bar moved as each is done."""
    bar = progress(what, len(prompts)) if progress is not None else _Silent()
    try:
        for prompt in prompts:
            yield prompt
            bar.update(1)
    finally:
        bar.close()


def run_plain(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop: Sequence[int] = (),
    progress: Optional[Progress] = None,
) -> List[Generation]:
    """Plain target decoding of every prompt (after one untimed warm-up)."""
    generate_plain(target, prompts[0], max_new_tokens=2)
    generator = torch.Generator().manual_seed(seed)
    return [
        generate_plain(
            target, p, max_new_tokens=max_new_tokens, temperature=temperature, generator=generator, stop_tokens=stop
        )
        for p in _each(prompts, progress, "target alone")
    ]


def run_speculative(
    target: nn.Module,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    gamma: Optional[int] = None,
    tree: Optional[Sequence[int]] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    stop: Sequence[int] = (),
    record_tv: bool = False,
    progress: Optional[Progress] = None,
) -> List[Generation]:
    speculative_generate(target, drafter, prompts[0], max_new_tokens=2, gamma=gamma, tree=tree)  # warm-up
    generator = torch.Generator().manual_seed(seed)
    return [
        speculative_generate(
            target,
            drafter,
            p,
            max_new_tokens=max_new_tokens,
            gamma=gamma,
            tree=tree,
            temperature=temperature,
            generator=generator,
            stop_tokens=stop,
            record_tv=record_tv,
        )
        for p in _each(prompts, progress, f"speculative ({drafter.name})")
    ]


def compare(
    target: nn.Module,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    gamma: Optional[int] = None,
    tree: Optional[Sequence[int]] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    stop: Sequence[int] = (),
    baseline: Optional[List[Generation]] = None,
    record_tv: bool = False,
    measure_baseline: bool = True,
    progress: Optional[Progress] = None,
) -> Dict[str, Any]:
    """Speculative decoding vs plain decoding on the same prompts -> the report's numbers.

    Pass `baseline` (from run_plain) to reuse one baseline measurement for several drafters;
    measure_baseline False: none at all (tau and acceptance only: speedup and the lossless check
    are None). record_tv: also report mean TV(p, q) over the checked chain positions (one
    (gamma, V) reduction per round inside the timed loop: well under 1% of a verification pass).
    progress: a bar per phase, moved per prompt.
    """
    gamma = drafter.default_depth if gamma is None else gamma
    check_shape(gamma, tree)
    _warn_if_deeper_than_trained(drafter, len(tree) if tree else gamma, "tree depth" if tree else "gamma")
    if baseline is None and measure_baseline:
        baseline = run_plain(
            target,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            stop=stop,
            progress=progress,
        )
    generations = run_speculative(
        target,
        drafter,
        prompts,
        gamma=gamma,
        tree=tree,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        stop=stop,
        record_tv=record_tv,
        progress=progress,
    )
    report: Dict[str, Any] = {
        "drafter": drafter.name,
        "gamma": None if tree else gamma,
        "tree": list(tree) if tree else None,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "prompts": len(prompts),
    }
    report.update(acceptance_stats(generations, len(tree) if tree else gamma))
    report.update(timing_stats(generations, baseline))
    # greedy decoding is deterministic, so lossless means token-identical output
    report["matches_target"] = (
        all(g.tokens == b.tokens for g, b in zip(generations, baseline))
        if temperature <= 0 and baseline is not None
        else None
    )
    return report


def _warn_if_deeper_than_trained(drafter: Drafter, depth: int, what: str) -> None:
    trained = drafter.trained_depth
    if trained is not None and depth > trained:
        log.warning(
            f"specdraft: warning: {what} {depth} drafts deeper than the {trained} tokens ahead "
            f"the draft was trained for; positions past {trained} run where training never went"
        )


def check_shape(gamma: Optional[int], tree: Optional[Sequence[int]]) -> None:
    if tree is not None:
        if not tree or any(int(w) < 1 for w in tree):
            raise SpecdraftError(f"tree widths must be positive integers, got {list(tree)}")
    elif gamma is not None and gamma < 1:
        raise SpecdraftError(f"gamma must be >= 1, got {gamma}")


@torch.no_grad()
def measure_tau(
    target: nn.Module,
    draft: nn.Module,
    tokenizer,
    prompts: Sequence[Union[str, Sequence[int]]],
    gamma: Optional[int] = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
) -> Dict[str, Any]:
    """Chain tau of a (plain, non-DeepSpeed) draft module: for the training loop's evals.

    Greedy at temperature 0; at temperature > 0 speculative sampling from a generator seeded with
    `seed` (the same on every rank), and mean TV(p, q) over the checked positions is reported too.
    prompts: user messages (wrapped with the chat template) or token id lists. The draft is put
    in eval mode for the measurement and its train/eval mode restored afterwards. gamma None:
    the depth the draft was trained for.
    """
    ids = [
        encode_messages(tokenizer, [{"role": "user", "content": p}]) if isinstance(p, str) else list(p) for p in prompts
    ]
    was_training = draft.training
    draft.eval()
    try:
        drafter = make_drafter("draft", target, draft)
        gamma = drafter.default_depth if gamma is None else gamma
        stop = stop_tokens(target, tokenizer)
        generator = torch.Generator().manual_seed(seed)
        generations = [
            speculative_generate(
                target,
                drafter,
                p,
                max_new_tokens=max_new_tokens,
                gamma=gamma,
                temperature=temperature,
                generator=generator,
                stop_tokens=stop,
                record_tv=temperature > 0,
            )
            for p in ids
        ]
    finally:
        draft.train(was_training)
    stats = acceptance_stats(generations, gamma)
    stats["generated_tokens"] = sum(len(g.tokens) for g in generations)
    return stats
