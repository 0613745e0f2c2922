"""A conversation -> token ids with the target's chat template, loss mask on assistant text only."""

from __future__ import annotations

from typing import List, Tuple

from specdraft.data.sources import Message
from specdraft.errors import SpecdraftError


def tokenize_conversation(tokenizer, messages: List[Message], where: str) -> Tuple[List[int], List[int]]:
    """(ids, mask): mask[j] = 1 when token j is assistant-written and so a training label.

    Assistant spans are found by rendering the template up to each assistant turn: the text with
    the generation prompt must be a prefix of the text with the answer (true for ChatML, Llama-3,
    Qwen templates); the answer is what lies between the two.
    """
    text = _render(tokenizer, messages, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], where, add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[:i + 1], where)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise SpecdraftError(f"{where}: the tokenizer's chat template does not render turn {i} "
                                 f"as a prefix of the conversation; cannot locate the assistant text")
        spans.append((len(before), len(upto)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in encoded["offset_mapping"]]
    return ids, mask


def _render(tokenizer, messages, where, add_generation_prompt=False) -> str:
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja raises its own types for a template's errors
        raise SpecdraftError(f"{where}: the chat template failed on this conversation: {err}") from None
