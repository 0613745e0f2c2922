"""A conversation -> token ids with the target's chat template, loss mask on assistant text only.

The conversation is rendered ONCE, whole, as the server renders it (templates rewrite history:
Qwen3 and DeepSeek-R1 drop the reasoning of earlier turns, so a prefix render is not a prefix).
Each assistant turn is then located by the template's own behaviour, never by searching its text:
the conversation is rendered again with that turn's content replaced by a marker, and the answer
is what lies between the longest common prefix and suffix of the two renders (clamped to the
marker), so no header, role name or earlier turn can be taken for it. Whatever the template does
to the content (`| trim`, `' ' + content`, dropping a think block) is thereby what is trained.
When the two renders part before the marker, the template renders part of the content there
(Qwen3 re-renders the last turn's think block, whose `<think>\\n` the marker's render shares): the
span then starts at the end of the generation prompt, where the target starts writing.

The mask covers the tokens that overlap each answer plus its end-of-turn (the first special
token after it, when only whitespace lies between; none for a turn marked "truncated", an answer
cut at its token budget), nothing else. An assistant turn that carries
`token_ids` (what the target generated, from `specdraft regenerate`) contributes exactly those ids
in place of its text, where the template rendered its content unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from specdraft.data.sources import Message, SkippedRow
from specdraft.errors import SpecdraftError

THINK_END = "</think>"
MARKER = "\ue000specdraft-answer-{}\ue001"  # private-use characters, no whitespace: survives trim


@dataclass(frozen=True)
class Span:
    """One assistant turn in the rendered text: [start, end) its answer, [end, stop) its end-of-turn."""

    start: int
    end: int
    stop: int
    token_ids: Optional[List[int]] = None  # the generated ids, placed at [start, end)


def template_kwargs(thinking: Optional[bool]) -> Dict[str, bool]:
    """apply_chat_template's extra arguments for a thinking setting (None: the template's default)."""
    return {} if thinking is None else {"enable_thinking": bool(thinking)}


def render_prompt(tokenizer, messages: List[Message], where: str, thinking: Optional[bool] = None) -> str:
    """The text a server feeds the target for the next assistant turn (generation prompt opened)."""
    return render(tokenizer, messages, where, add_generation_prompt=True, thinking=thinking)


def no_template_error(where: str) -> SpecdraftError:
    """A chat row for a tokenizer without a chat template (a base model): every row would fail alike."""
    return SpecdraftError(
        f"{where}: the target's tokenizer has no chat template (a base model?), so chat rows cannot be "
        f"rendered: save one as chat_template.jinja in the target's directory, or give plain-text rows "
        '({"text": "..."})'
    )


def render(tokenizer, messages, where, add_generation_prompt=False, thinking=None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise no_template_error(where)
    try:
        return tokenizer.apply_chat_template(
            [_plain(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs(thinking),
        )
    except Exception as err:  # jinja raises its own types for a template's errors
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SkippedRow(
            where, "template refused", f"the chat template cannot render this conversation: {first}"
        ) from None


def tokenize_text(tokenizer, text: str) -> Tuple[List[int], List[int]]:
    """A plain-text row: its tokens as the tokenizer encodes a document (its BOS, when it adds one),
    every token after the first a label."""
    ids = list(tokenizer(text)["input_ids"])
    return ids, [0] + [1] * (len(ids) - 1)


def tokenize_conversation(
    tokenizer, messages: List[Message], where: str, thinking: Optional[bool] = None
) -> Tuple[List[int], List[int]]:
    """(ids, mask): mask[j] = 1 when token j is assistant-written and so a training label.

    Raises SkippedRow when the row has nothing to learn (the template refuses it, or every answer
    renders empty)."""
    text = render(tokenizer, messages, where, thinking=thinking)
    spans = [s for s in assistant_spans(tokenizer, messages, where, thinking, text) if text[s.start : s.end].strip()]
    if not spans:
        raise SkippedRow(where, "empty answer", "every assistant answer renders empty")
    ids: List[int] = []
    mask: List[int] = []
    special = special_ids(tokenizer)
    cursor = 0
    for span in spans:
        if span.token_ids is None:
            continue
        _encode(tokenizer, text, cursor, span.start, spans, ids, mask)
        answer = _strip_trailing(span.token_ids, special)
        ids.extend(answer)
        mask.extend([1] * len(answer))
        cursor = span.end
    _encode(tokenizer, text, cursor, len(text), spans, ids, mask)
    return ids, mask


def assistant_spans(
    tokenizer, messages: List[Message], where: str, thinking: Optional[bool] = None, text: Optional[str] = None
) -> List[Span]:
    """The Span of every assistant turn in the render of the whole conversation (`text`)."""
    if text is None:
        text = render(tokenizer, messages, where, thinking=thinking)
    marker = _unused_marker(text, messages)
    stops = sorted(special_strings(tokenizer), key=len, reverse=True)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        marked = render(
            tokenizer,
            messages[:k] + [{"role": "assistant", "content": marker}] + messages[k + 1 :],
            where,
            thinking=thinking,
        )
        at = marked.find(marker)
        if at < 0 or marked.find(marker, at + 1) >= 0:
            raise SkippedRow(
                where,
                "answer not rendered",
                f"assistant turn {k} does not appear in the chat template's render of the conversation",
            )
        after = len(marked) - at - len(marker)  # the render's text after the answer
        shared = _common_prefix(text, marked)
        start = min(shared, at)
        if shared < at:  # the renders part before the answer: the template renders part of the content there
            start = _generation_prompt_end(tokenizer, messages[:k], where, thinking, text, start)
        end = max(start, len(text) - min(_common_suffix(text, marked), after))
        ids = message.get("token_ids")
        if ids is not None and text[start:end] != message["content"]:
            ids = None  # the template rewrote the answer (trim, think dropped): its text is trained instead
        stop = end if message.get("truncated") else _end_of_turn(text, end, stops)  # cut short: no end learnt
        spans.append(Span(start, end, stop, ids))
    return spans


def _generation_prompt_end(tokenizer, history, where, thinking, text, start) -> int:
    """Where the answer begins when the template renders part of it before the point where the two
    renders part (Qwen3 re-renders the answer's think block: its `<think>\n` is the same for the
    marker): the end of the generation prompt, where the target starts writing, when that is a
    prefix of the render before `start`; `start` otherwise."""
    if not history:
        return start
    try:
        prompt = render(tokenizer, history, where, add_generation_prompt=True, thinking=thinking)
    except SkippedRow:
        return start
    return len(prompt) if len(prompt) <= start and text.startswith(prompt) else start


def _end_of_turn(text: str, end: int, stops: List[str]) -> int:
    """End of the special token that closes the answer at `end` (whitespace may come first)."""
    j = end
    while j < len(text) and text[j].isspace():
        j += 1
    for token in stops:  # longest first
        if text.startswith(token, j):
            return j + len(token)
    return end


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))  # binary search on slices: C-speed comparisons
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _unused_marker(text: str, messages: List[Message]) -> str:
    n = 0
    while MARKER.format(n) in text or any(MARKER.format(n) in m["content"] for m in messages):
        n += 1
    return MARKER.format(n)


def special_ids(tokenizer) -> set:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special)
    return ids


def special_strings(tokenizer) -> set:
    strings = set(tokenizer.all_special_tokens)
    strings.update(token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special)
    return {s for s in strings if s}


def _encode(tokenizer, text: str, lo: int, hi: int, spans: List[Span], ids, mask) -> None:
    """Tokenise text[lo:hi]; a token is trained when it overlaps an answer or its end-of-turn."""
    if hi <= lo:
        return
    encoded = tokenizer(text[lo:hi], add_special_tokens=False, return_offsets_mapping=True)
    for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        a, b = a + lo, b + lo
        ids.append(token)
        mask.append(int(any(_overlaps(a, b, s.start, s.stop) for s in spans)))


def _overlaps(a: int, b: int, start: int, stop: int) -> bool:
    return (a < stop and b > start) if b > a else start <= a < stop


def _strip_trailing(ids: List[int], special) -> List[int]:
    """The answer's own tokens: generated ids less the stop token(s) the template renders itself."""
    ids = [int(t) for t in ids]
    while ids and ids[-1] in special:
        ids.pop()
    return ids


def _plain(message: Message) -> Dict[str, str]:
    return {"role": message["role"], "content": message["content"]}
