"""Prompts as a server renders them: a jsonl prompt file or chat messages -> token ids through the
chat template, and the target's end-of-turn ids."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from torch import nn

from specdraft.data.chat import no_template_error
from specdraft.data.sources import is_prompt_row, iter_jsonl_records, normalise_conversation
from specdraft.errors import SpecdraftError


def stop_tokens(target: nn.Module, tokenizer=None) -> List[int]:
    """End-of-turn ids: the target's generation_config eos (int or list) and the tokenizer's eos."""
    ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def encode_messages(tokenizer, messages: List[Dict[str, str]], thinking: Optional[bool] = None) -> List[int]:
    """Chat template with the generation prompt, as a server renders it (`thinking`: the template's
    enable_thinking, as the training data used; None: its default); plain text without a template
    (a base model's {"prompt": text} rows: read_prompts refuses conversations there)."""
    if getattr(tokenizer, "chat_template", None):
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


def _prompt_messages(record, where: str) -> List[Dict[str, str]]:
    """The turns a server would be prompted with: a {"prompt": text} row, or a conversation up to
    its last assistant turn."""
    messages = normalise_conversation(record, where, require_answer=False)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    context = messages[: assistant[-1]] if assistant else messages  # up to the last answer
    if not context:
        raise SpecdraftError(f"{where}: no turns before the last assistant turn (nothing to prompt with)")
    return [{"role": m["role"], "content": m["content"]} for m in context]


def read_prompts(
    prompts_file, tokenizer, max_prompts: Optional[int] = None, thinking: Optional[bool] = None
) -> List[List[int]]:
    """Token ids of each line of a jsonl prompt file ({"prompt": ...} or {"conversations": ...})."""
    path = Path(prompts_file)
    if not path.is_file():
        raise SpecdraftError(f"{path}: prompts file not found")
    prompts: List[List[int]] = []
    chat = bool(getattr(tokenizer, "chat_template", None))
    for where, record in iter_jsonl_records(path):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        if not chat and not is_prompt_row(record):  # a base model: {"prompt": text} rows, as plain text
            raise no_template_error(where)
        prompts.append(encode_messages(tokenizer, _prompt_messages(record, where), thinking))
    if not prompts:
        raise SpecdraftError(f"{path}: no prompts")
    return prompts


def encode_conversation(tokenizer, messages: List[Dict[str, str]]) -> List[int]:
    """A whole conversation, answers included, as the chat template renders it (no generation prompt)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


def pad_with_earlier_conversations(prompt: List[int], earlier: List[List[int]], context: int) -> List[int]:
    """The prompt preceded by earlier conversations, `context` tokens in all: the prompt's tokens
    last, before it earlier[0] whole, before that earlier[1] whole, ...; only the oldest one used
    is cut, from its start, to make the length exact (a long-context acceptance probe: does a draft
    trained at length L hold its tau with L-2L-4L tokens of history before the prompt?)."""
    if len(prompt) >= context:
        raise SpecdraftError(f"--context {context}: a prompt is already {len(prompt)} tokens long")
    pieces, need = [], context - len(prompt)
    for conversation in earlier:
        if need == 0:
            break
        piece = conversation[-need:] if len(conversation) > need else conversation
        pieces.insert(0, list(piece))
        need -= len(piece)
    if need:
        raise SpecdraftError(
            f"--context {context}: the earlier conversations hold {context - len(prompt) - need} "
            f"tokens, {need} short of padding a {len(prompt)}-token prompt"
        )
    return [token for piece in pieces for token in piece] + list(prompt)
