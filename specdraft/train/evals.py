"""Tau measured during training on held-out prompts, logged beside the loss (eval_steps)."""

from __future__ import annotations

from omegaconf import DictConfig

from specdraft.parallel.zero import gathered
from specdraft.train.engine import steps_of_their_own


EVAL_PROMPTS = 8  # held-out prompts per in-training tau measurement


EVAL_NEW_TOKENS = 32


def load_eval_prompts(cfg: DictConfig, tokenizer) -> list:
    if cfg.eval_steps <= 0 or not cfg.eval_prompts:
        return []
    from specdraft.decode.prompts import read_prompts

    return read_prompts(cfg.eval_prompts, tokenizer, max_prompts=EVAL_PROMPTS, thinking=cfg.thinking)


def measure_draft_tau(engine, target, tokenizer, prompts: list, temperature: float = 0.0, seed: int = 0) -> dict:
    """Chain tau of the current draft on held-out prompts, logged beside the loss: greedy, or
    sampled at `temperature` (then also eval/tv, TV(target p, draft q) at the checked positions).

    Every rank runs it in lockstep (identical work: the sampler is seeded alike). Under ZeRO-3 only
    the draft and the lm_head it reads as a tensor are gathered for the whole measurement; the
    target's layers are gathered one module at a time by ZeRO-3's own hooks as decoding calls them,
    so no rank ever holds the whole target. Each target / draft forward is a ZeRO-3 step of its
    own, so decoding never lands in the trace ZeRO-3 prefetches training along.
    `target` is the causal LM whose decoder stack and lm_head the engine's module holds.
    """
    from specdraft.decode.measure import measure_tau

    module = engine.module
    with gathered(module.decoding_parameters()), steps_of_their_own(engine, [target, module.draft_model]):
        stats = measure_tau(
            target,
            module.draft_model,
            tokenizer,
            prompts,
            max_new_tokens=EVAL_NEW_TOKENS,
            temperature=temperature,
            seed=seed,
        )
    values = {"eval/tau": stats["tau"]}
    if stats.get("mean_tv") is not None:
        values["eval/tv"] = stats["mean_tv"]
    values.update({f"eval/accept_{i + 1}": a for i, a in enumerate(stats.get("acceptance_per_position", []))})
    return values
