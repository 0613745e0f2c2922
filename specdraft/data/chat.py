"""A conversation -> token ids with the target's chat template, loss mask on assistant text only.

The conversation is rendered ONCE, whole, as the server renders it; each assistant turn is then
located in that text. Rendering up to each turn instead breaks on templates that rewrite history
(Qwen3 and DeepSeek-R1 drop the reasoning of earlier turns, so a prefix render is not a prefix).

The mask covers each assistant turn's text plus the end-of-turn token that follows it (the first
token after the text when it is a special token: <|im_end|>, <|eot_id|>, <end_of_turn>, </s>),
nothing of the template's headers. An assistant turn that carries `token_ids` (what the target
generated, written by `specdraft regenerate`) contributes exactly those ids, not a re-tokenisation
of its text, wherever the template rendered its text unchanged.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from specdraft.data.sources import Message
from specdraft.errors import SpecdraftError

THINK_END = "</think>"


def template_kwargs(thinking: Optional[bool]) -> Dict[str, bool]:
    """apply_chat_template's extra arguments for a thinking setting (None: the template's default)."""
    return {} if thinking is None else {"enable_thinking": bool(thinking)}


def render_prompt(tokenizer, messages: List[Message], where: str, thinking: Optional[bool] = None) -> str:
    """The text a server feeds the target for the next assistant turn (generation prompt opened)."""
    return render(tokenizer, messages, where, add_generation_prompt=True, thinking=thinking)


def render(tokenizer, messages, where, add_generation_prompt=False, thinking=None) -> str:
    try:
        return tokenizer.apply_chat_template([_plain(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **template_kwargs(thinking))
    except Exception as err:  # jinja raises its own types for a template's errors
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpecdraftError(f"{where}: the chat template cannot render this conversation: {first}") from None


def tokenize_conversation(tokenizer, messages: List[Message], where: str,
                          thinking: Optional[bool] = None) -> Tuple[List[int], List[int]]:
    """(ids, mask): mask[j] = 1 when token j is assistant-written and so a training label."""
    text = render(tokenizer, messages, where, thinking=thinking)
    spans = assistant_spans(text, messages, where)
    special = special_ids(tokenizer)
    ids: List[int] = []
    mask: List[int] = []
    cursor = 0
    for (lo, hi), given in spans:
        if given is None:
            continue
        _extend(ids, mask, tokenizer, text[cursor:lo], [(a - cursor, b - cursor) for (a, b), _ in spans], special)
        answer = _strip_trailing(given, special)
        ids.extend(answer)
        mask.extend([1] * len(answer))
        cursor = hi
    _extend(ids, mask, tokenizer, text[cursor:], [(a - cursor, b - cursor) for (a, b), _ in spans], special,
            after_answer=cursor > 0)
    return ids, mask


def assistant_spans(text: str, messages: List[Message], where: str):
    """[((start, end), token_ids or None)] of each assistant turn's text in the rendered `text`.

    Messages are looked up in order from a cursor, so an answer that repeats the question is
    found in its own turn. An assistant turn may be rendered whole or with its reasoning dropped
    (history of Qwen3 / DeepSeek-R1 templates); its ids are used only when rendered whole."""
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant":
            found = text.find(content, cursor) if content else -1
            if found >= 0:  # a template may rewrite a user turn (Gemma folds the system prompt in)
                cursor = found + len(content)
            continue
        candidates = [(content, message.get("token_ids"))]
        if THINK_END in content:
            answer = content.split(THINK_END)[-1]  # R1 keeps the newlines after </think>, Qwen3 strips them
            candidates += [(answer, None), (answer.lstrip("\n"), None)]
        located = [(text.find(c, cursor), -len(c), c, ids) for c, ids in candidates]
        located = sorted(loc for loc in located if loc[0] >= 0)
        if not located:
            raise SpecdraftError(f"{where}: assistant turn {i} does not appear in the chat template's "
                                 f"render of the conversation; cannot locate its text")
        start, _, found_text, ids = located[0]
        spans.append(((start, start + len(found_text)), ids))
        cursor = start + len(found_text)
    return spans


def special_ids(tokenizer) -> set:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special)
    return ids


def _extend(ids, mask, tokenizer, piece: str, spans, special, after_answer=False) -> None:
    """Tokenise `piece` (offsets relative to it) and mask the tokens inside `spans` plus the
    special token right after each span (its end-of-turn); `after_answer`: the piece starts right
    after an answer given as ids, so its first special token is that answer's end-of-turn."""
    if not piece:
        return
    encoded = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
    piece_ids = list(encoded["input_ids"])
    starts = [start for start, _ in encoded["offset_mapping"]]
    ends = sorted(hi for lo, hi in spans if hi >= 0)
    if after_answer:
        ends = [0] + ends
    for k, (token, start) in enumerate(zip(piece_ids, starts)):
        inside = any(lo <= start < hi for lo, hi in spans)
        end_of_turn = token in special and not inside and _first_after(starts, k, ends)
        ids.append(token)
        mask.append(int(inside or end_of_turn))


def _first_after(starts, k, ends) -> bool:
    """Token k is the first token at or after some span end."""
    return any(starts[k] >= e and (k == 0 or starts[k - 1] < e) for e in ends)


def _strip_trailing(ids: List[int], special) -> List[int]:
    """The answer's own tokens: generated ids less the stop token(s) the template renders itself."""
    ids = [int(t) for t in ids]
    while ids and ids[-1] in special:
        ids.pop()
    return ids


def _plain(message: Message) -> Dict[str, str]:
    return {"role": message["role"], "content": message["content"]}
