"""The target writes answers: the backends of `specdraft regenerate`.

A backend takes requests (a conversation so far, a seed) and returns each one's answer: the token
ids the target generated (its stop token included when it stopped) and their text.

    HFBackend       transformers `generate` in batches (left padding, KV cache), bf16 on a GPU
    (OpenAIBackend  in regenerate/openai_backend.py: OpenAI-compatible servers)

Nothing about an answer depends on which rows shared its batch: each row samples from its own
seeded generator, and each row stops at its own budget (a row that reaches it is finished, padded
while the others go on), so a rerun (or a resume) writes it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from specdraft.data.chat import render_prompt, special_ids
from specdraft.errors import SpecdraftError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    max_length: int = 4096  # prompt + answer tokens
    thinking: Optional[bool] = None  # enable_thinking for templates that have it; None: their default

    def check(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise SpecdraftError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecdraftError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1 or self.max_length < 2:
            raise SpecdraftError("max_new_tokens must be >= 1 and max_length >= 2")


@dataclass
class Request:
    messages: list  # the conversation so far; the answer opens a new assistant turn
    seed: int
    where: str = ""


@dataclass
class Answer:
    text: str = ""
    token_ids: Optional[List[int]] = None  # what the target generated; None: the server did not say
    tokens: int = 0  # generated tokens (for tok/s)
    finish: str = "stop"  # stop | length
    error: Optional[str] = None  # set: no answer (the row goes to the errors file)
    server_error: bool = False  # the server gave no answer (HTTP, transport): the row "failed", else "skipped"


def prompt_ids(tokenizer, request: Request, sampling: Sampling):
    """(ids, new-token budget, None), or (.., .., why) when the row cannot be asked: the template
    refuses it (assistant first, roles that do not alternate) or its prompt is too long."""
    if not request.messages:
        return [], 0, "no prompt: the row starts with an assistant turn"
    try:
        text = render_prompt(tokenizer, request.messages, request.where, sampling.thinking)
    except SpecdraftError as err:  # the row's problem, not the run's: the others go on
        reason = str(err)
        return [], 0, reason[len(request.where) + 2 :] if reason.startswith(f"{request.where}: ") else reason
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    room = sampling.max_length - len(ids)
    if room < 1:
        return ids, 0, f"too long: the prompt has {len(ids)} tokens, max_length is {sampling.max_length}"
    return ids, min(sampling.max_new_tokens, room), None


def stop_ids(tokenizer, model=None) -> set:
    """Generation ends at any special token (the end-of-turn the template renders, eos, ...)."""
    ids = special_ids(tokenizer)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([] if eos is None else [eos] if isinstance(eos, int) else eos)
    return ids


def finish_answer(tokenizer, generated: Sequence[int], stops: set, budget: int) -> Answer:
    """Cut the generated ids after their first stop token within the row's budget; the text is the
    ids before it. No stop within the budget: the answer is truncated (finish "length")."""
    ids = [int(t) for t in generated][:budget]
    cut = next((k for k, t in enumerate(ids) if t in stops), None)
    if cut is None:
        return Answer(tokenizer.decode(ids), ids, len(ids), "length")
    return Answer(tokenizer.decode(ids[:cut]), ids[: cut + 1], cut + 1, "stop")


class RowSampler:
    """A logits processor: each row samples its next token from its own seeded generator, at
    `temperature` within the top_p nucleus, and returns that choice as the only finite logit (so
    greedy decoding picks it)."""

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float, device):
        self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids, scores):
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # keeps the top token
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0))
        choice = torch.stack(
            [torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(self.generators)]
        )  # (B, 1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, choice, 0.0)


class RowBudgets(StoppingCriteria):
    """Each row of a batch is done once it has generated its own budget of tokens: its answer is
    the one it gets alone, and generate stops when every row is done."""

    def __init__(self, prompt_width: int, budgets: Sequence[int], device):
        self.prompt_width = prompt_width
        self.budgets = torch.tensor(list(budgets), device=device)

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_width) >= self.budgets  # (B,) bool


@dataclass
class HFBackend:
    """transformers generate on the target: batches of similar length, left padded."""

    model: object
    tokenizer: object
    sampling: Sampling
    batch_size: int = 32
    name: str = field(default="hf", init=False)

    @classmethod
    def load(cls, target_dir, sampling: Sampling, batch_size: int = 32, device=None) -> HFBackend:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
        return cls(model, tokenizer, sampling, batch_size)

    @torch.inference_mode()
    def generate(self, requests: List[Request], progress: Callable[[int], None] = lambda n: None) -> List[Answer]:
        answers: List[Optional[Answer]] = [None] * len(requests)
        encoded = {}
        for i, request in enumerate(requests):
            ids, budget, error = prompt_ids(self.tokenizer, request, self.sampling)
            if error:
                answers[i] = Answer(error=error)
            else:
                encoded[i] = (ids, budget)
        order = sorted(encoded, key=lambda i: len(encoded[i][0]))  # little padding per batch
        for b in range(0, len(order), self.batch_size):
            rows = order[b : b + self.batch_size]
            for i, answer in zip(rows, self._batch([encoded[i] for i in rows], [requests[i].seed for i in rows])):
                answers[i] = answer
                progress(answer.tokens)
        return answers

    def _batch(self, prompts, seeds) -> List[Answer]:
        device = self.model.device
        width = max(len(ids) for ids, _ in prompts)
        budget = max(b for _, b in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        input_ids = torch.full((len(prompts), width), pad, device=device)  # (B, T), left padded
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for j, (ids, _) in enumerate(prompts):
            input_ids[j, width - len(ids) :] = torch.tensor(ids, device=device)
            attention_mask[j, width - len(ids) :] = 1
        stops = stop_ids(self.tokenizer, self.model)
        processors = []
        if self.sampling.temperature > 0:
            processors = [RowSampler(seeds, self.sampling.temperature, self.sampling.top_p, device)]
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=budget,
            do_sample=False,
            logits_processor=processors,
            eos_token_id=sorted(stops),
            stopping_criteria=StoppingCriteriaList([RowBudgets(width, [b for _, b in prompts], device)]),
            pad_token_id=pad,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        return [
            finish_answer(self.tokenizer, out[j, width:].tolist(), stops, prompts[j][1]) for j in range(len(prompts))
        ]
