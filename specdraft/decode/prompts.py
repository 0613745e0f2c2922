"""Prompts as a server renders them: a jsonl prompt file or chat messages -> token ids through the
chat template, and the target's end-of-turn ids."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from torch import nn

from specdraft.data.sources import iter_jsonl_records
from specdraft.errors import SpecdraftError

ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


def stop_tokens(target: nn.Module, tokenizer=None) -> List[int]:
    """End-of-turn ids: the target's generation_config eos (int or list) and the tokenizer's eos."""
    ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def encode_messages(tokenizer, messages: List[Dict[str, str]], thinking: Optional[bool] = None) -> List[int]:
    """Chat template with the generation prompt, as a server renders it (`thinking`: the template's
    enable_thinking, as the training data used; None: its default); plain text without a template."""
    if getattr(tokenizer, "chat_template", None):
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


def _prompt_messages(record, where: str) -> List[Dict[str, str]]:
    if not isinstance(record, dict):
        raise SpecdraftError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            raise SpecdraftError(f"{where}: 'prompt' must be a non-empty string")
        return [{"role": "user", "content": record["prompt"]}]
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise SpecdraftError(f"{where}: expected {{\"prompt\": text}} or a non-empty 'conversations' list")
    messages = []
    for i, turn in enumerate(turns):
        role = ROLES.get(turn.get("role", turn.get("from"))) if isinstance(turn, dict) else None
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            raise SpecdraftError(f"{where}: turn {i} needs a known 'role' and a text 'content'")
        messages.append({"role": role, "content": content})
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    context = messages[:assistant[-1]] if assistant else messages  # up to the last answer
    if not context:
        raise SpecdraftError(f"{where}: no turns before the last assistant turn (nothing to prompt with)")
    return context


def read_prompts(prompts_file, tokenizer, max_prompts: Optional[int] = None,
                 thinking: Optional[bool] = None) -> List[List[int]]:
    """Token ids of each line of a jsonl prompt file ({"prompt": ...} or {"conversations": ...})."""
    path = Path(prompts_file)
    if not path.is_file():
        raise SpecdraftError(f"{path}: prompts file not found")
    prompts: List[List[int]] = []
    for where, record in iter_jsonl_records(path):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        prompts.append(encode_messages(tokenizer, _prompt_messages(record, where), thinking))
    if not prompts:
        raise SpecdraftError(f"{path}: no prompts")
    return prompts
