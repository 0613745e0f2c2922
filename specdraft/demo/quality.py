"""Answer quality figures of a target: does it answer like a model, or loop?

A target whose greedy answers repeat one line makes every draft (and prompt lookup, which copies
earlier tokens) look better than it would on a real model. Three figures say how far a target is
from that:

- distinct-2 of its answers (`distinct_2`): few distinct bigrams = repetition;
- the share of degenerate answers (`is_degenerate`): one line repeated through the answer;
- prompt lookup's τ (`measure_answer_quality`): a model-free drafter that copies the sequence's
  own earlier n-grams; a τ well above 1.5 means the answers mostly repeat themselves.

`measure_answer_quality` gets all three from one greedy pass per prompt: speculative decoding with
prompt lookup is lossless, so the tokens it produces are the target's greedy answer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

from specdraft.decode.drafters import PromptLookupDrafter
from specdraft.decode.report import acceptance_stats
from specdraft.decode.speculative import speculative_generate
from specdraft.demo.corpus import extract_functions, read_corpus
from specdraft.demo.presets import get_preset

LOOKUP_GAMMA = 5  # prompt lookup's chain length, as bench/acceptance.py measures it


def distinct_2(answers: Iterable[Sequence[int]]) -> float:
    """Distinct token bigrams / all token bigrams, pooled over `answers` (token id lists).

    A bigram is two adjacent tokens of one answer (none spans two answers), so an answer of n
    tokens has n - 1 of them. The denominator counts every occurrence, sum(n - 1); the numerator
    counts each different (a, b) pair once over all answers. 1.0: no bigram occurs twice; an
    answer repeating one line k times brings that line's bigrams k times. 0.0 when no answer has
    two tokens. Pooled (not a mean of per-answer ratios): two answers that repeat each other count
    as repetition too.
    """
    seen, total = set(), 0
    for answer in answers:
        pairs = list(zip(answer, answer[1:]))
        seen.update(pairs)
        total += len(pairs)
    return len(seen) / total if total else 0.0


def is_degenerate(text: str) -> bool:
    """An answer whose most repeated line is more than a quarter of its lines.

    Lines are compared without their leading/trailing white space, and blank lines are not
    counted. A line must occur at least twice: a one- to three-line answer is not a loop.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return False
    top = max(Counter(lines).values())
    return top >= 2 and top > len(lines) / 4


def degenerate_share(texts: Sequence[str]) -> float:
    """The fraction of `texts` that `is_degenerate`; 0.0 for none."""
    return sum(map(is_degenerate, texts)) / len(texts) if texts else 0.0


@dataclass(frozen=True)
class AnswerQuality:
    answers: int
    distinct_2: float
    degenerate: float  # share of answers
    lookup_tau: Optional[float]  # None where not measured (answers without their target)
    mean_tokens: float
    ended: Optional[float]  # share of answers that ended their turn before the token limit

    def line(self) -> str:
        tau = "" if self.lookup_tau is None else f", prompt lookup τ {self.lookup_tau:.2f}"
        ended = "" if self.ended is None else f", {self.ended:.0%} ended their turn"
        return (
            f"{self.answers} answers, {self.mean_tokens:.0f} tokens on average{ended}: "
            f"distinct-2 {self.distinct_2:.2f}, degenerate {self.degenerate:.0%}{tau}"
        )


def quality_of_texts(tokenizer, texts: Sequence[str]) -> AnswerQuality:
    """distinct-2 and degenerate share of answer texts (e.g. a regenerated dataset's answers),
    tokenized with the target's tokenizer; no target needed, so no prompt lookup τ.

    The data build prints it: log(f"[demo data] answers: {quality_of_texts(tokenizer, answers).line()}")"""
    ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    return AnswerQuality(
        answers=len(texts),
        distinct_2=distinct_2(ids),
        degenerate=degenerate_share(texts),
        lookup_tau=None,
        mean_tokens=sum(map(len, ids)) / len(ids) if ids else 0.0,
        ended=None,
    )


def measure_answer_quality(
    target,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop: Sequence[int],
    gamma: int = LOOKUP_GAMMA,
) -> tuple[AnswerQuality, List[str]]:
    """The three figures of `target`'s greedy answers to `prompts` (token ids, chat-templated),
    and the answers' texts. One speculative pass per prompt with prompt lookup drafting `gamma`
    tokens: its output is the greedy answer (lossless), its acceptance is prompt lookup's τ.
    An answer is its tokens before the first stop token."""
    stop_set = set(stop)
    generations = [
        speculative_generate(
            target, PromptLookupDrafter(), p, max_new_tokens=max_new_tokens, gamma=gamma, stop_tokens=stop
        )
        for p in prompts
    ]
    answers, ended = [], []
    for g in generations:
        cut = next((i for i, t in enumerate(g.tokens) if t in stop_set), None)
        answers.append(g.tokens if cut is None else g.tokens[:cut])
        ended.append(cut is not None)
    texts = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
    quality = AnswerQuality(
        answers=len(answers),
        distinct_2=distinct_2(answers),
        degenerate=degenerate_share(texts),
        lookup_tau=acceptance_stats(generations, gamma)["tau"],
        mean_tokens=sum(map(len, answers)) / len(answers) if answers else 0.0,
        ended=sum(ended) / len(ended) if ended else 0.0,
    )
    return quality, texts


# -- which prompts -------------------------------------------------------------------------------


def _short_prompts(tokenizer, functions, max_prompt_tokens: int, seed: int) -> List[str]:
    """User messages of `functions` whose chat prompt fits `max_prompt_tokens`, seeded order."""
    import random

    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f.prompt}], add_generation_prompt=True, tokenize=False
        )
        for f in functions
    ]
    lengths = [len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    prompts = [f.prompt for f, n in zip(functions, lengths) if n <= max_prompt_tokens]
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts(tokenizer, preset: str, seed: int) -> List[str]:
    """The preset dataset's held-out prompts (its prompts.jsonl), chosen as the data build chooses
    them, without building the data: functions absent from the drafts' training rows — but in the
    target's pre-training text, as every function of the corpus is."""
    p = get_preset(preset)
    functions = extract_functions(read_corpus(p.corpus_bytes, seed))
    return _short_prompts(tokenizer, functions, p.max_prompt_tokens, seed)[: p.prompt_rows]


def unseen_prompts(tokenizer, after_bytes: int, seed: int, count: int, max_prompt_tokens: int) -> List[str]:
    """`count` prompts from stdlib files that a corpus of `after_bytes` does not read: functions no
    target built from at most that many bytes was pre-trained on."""
    seen = read_corpus(after_bytes, seed)
    everything = read_corpus(10**12, seed)  # the same seeded order, read to the end
    known = {f.prompt for f in extract_functions(seen)}
    fresh = [f for f in extract_functions(everything[len(seen) :]) if f.prompt not in known]
    return _short_prompts(tokenizer, fresh, max_prompt_tokens, seed)[:count]
