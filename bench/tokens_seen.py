"""Token counts on a bench's command line (--tokens-seen, --tokens): '30k' read as a count, and
counts turned into the optimizer steps that see them."""

from __future__ import annotations

import sys
from math import gcd
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdraft.errors import SpecdraftError  # noqa: E402

SAVES_PER_POINT = 4  # --tokens-seen: at most this many exports saved per measured point


def parse_count(text: str) -> int:
    """'30k' -> 30000, '1.5M' -> 1500000, '2048' -> 2048."""
    text = text.strip()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise SpecdraftError(f"--tokens-seen {text!r}: a count such as 30k, 0.3M or 2048") from None
    if value < 1:
        raise SpecdraftError(f"--tokens-seen {text!r}: must be at least one token")
    return int(round(value))


def steps_for_tokens(counts: List[int], tokens_per_step: int) -> List[int]:
    """Optimizer steps that see (at least) each count of tokens, in order, each at least 1."""
    steps = [max(1, -(-count // tokens_per_step)) for count in counts]
    if steps != sorted(set(steps)):
        raise SpecdraftError(
            f"--tokens-seen: {counts} are {steps} steps of {tokens_per_step} tokens; "
            f"give increasing counts at least one step apart"
        )
    # the run exports every gcd(steps) steps to have each point: steps sharing no divisor would
    # save five drafts at (nearly) every step
    divisor = gcd(*steps)
    saves = steps[-1] // divisor
    if saves > SAVES_PER_POINT * len(steps):
        first = steps[0]
        multiples = [first * -(-step // first) for step in steps]
        suggestion = ",".join(f"{step * tokens_per_step / 1000:g}k" for step in multiples)
        raise SpecdraftError(
            f"--tokens-seen: {counts} are steps {steps} of {tokens_per_step} tokens, which share the "
            f"divisor {divisor}: the run would save {saves} exports; give counts whose steps are "
            f"multiples of one step count, e.g. {suggestion}"
        )
    return steps
