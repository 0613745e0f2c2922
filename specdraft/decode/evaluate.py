"""`specdraft eval`: tau, acceptance per position and speedup of a draft export on a prompt file.

    report = evaluate("runs/x", "prompts.jsonl")      # newest runs/x/step_<N>/, gamma: as trained
    print(format_report(report))                                     # specdraft.decode.report

Methods: "draft" (the exported draft), "untrained" (a freshly built draft of the same dims),
"prompt_lookup" (n-gram lookup, no model), "self" (the target drafting for itself: tau's ceiling).
Speedup is against plain target decoding of the same prompts, measured in the same call.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from specdraft.decode.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specdraft.decode.report import acceptance_stats, plot_acceptance, timing_stats
from specdraft.decode.speculative import Generation, generate_plain, speculative_generate
from specdraft.drafts import Draft, draft_from_export_config
from specdraft.drafts.io import CONFIG_NAME, load_exported_draft, read_export_config
from specdraft.data.sources import iter_jsonl_records
from specdraft.errors import SpecdraftError
from specdraft.train.checkpoint import exports

METHODS = ("draft", "untrained", "prompt_lookup", "self")
NEEDS_DRAFT = ("draft", "untrained")
log = logging.getLogger(__name__)
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


# -- locating the export, the target and the tokenizer ---------------------------------------

def resolve_export(path, target=None) -> Tuple[Optional[Path], Path]:
    """(export_dir or None, target_dir) for a run dir, an export dir or a target model dir.
    target: the target model directory to use instead of the one the export records (the
    absolute path it was trained at, which another machine does not have)."""
    path = Path(path)
    if not path.exists():
        raise SpecdraftError(f"{path}: not found")
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        steps = [d for d in exports(path) if (d / CONFIG_NAME).is_file()]
        if not steps:
            raise SpecdraftError(f"{path}: neither a draft export (no {CONFIG_NAME}) nor a run "
                                 f"directory (no step_<N>/ exports)")
        path = steps[-1]
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecdraftError(f"{path / CONFIG_NAME}: not readable JSON ({err})") from None
    if "architecture" not in config:  # a Hugging Face model directory: the target itself
        return None, path
    config = read_export_config(path)
    if target is not None:
        if not (Path(target) / CONFIG_NAME).is_file():
            raise SpecdraftError(f"--target {target}: not a model directory (no {CONFIG_NAME})")
        return path, Path(target)
    recorded = (config.get("target") or {}).get("path")
    if not recorded:
        raise SpecdraftError(f"{path / CONFIG_NAME}: names no target model; pass --target DIR")
    if not (Path(recorded) / CONFIG_NAME).is_file():
        raise SpecdraftError(f"{path / CONFIG_NAME}: the target it was trained with, {recorded}, is not there "
                             f"(no {CONFIG_NAME}); pass --target DIR")
    return path, Path(recorded)


def load_tokenizer(export_dir: Optional[Path], target_dir: Path):
    from transformers import AutoTokenizer

    for directory in (export_dir, target_dir):
        if directory is not None and any((directory / name).is_file()
                                         for name in ("tokenizer.json", "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(str(directory))
    raise SpecdraftError(f"{target_dir}: no tokenizer files (tokenizer.json / tokenizer_config.json)")


def stop_tokens(target: nn.Module, tokenizer=None) -> List[int]:
    """End-of-turn ids: the target's generation_config eos (int or list) and the tokenizer's eos."""
    ids = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


# -- prompts ---------------------------------------------------------------------------------

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


# -- running ---------------------------------------------------------------------------------

def resolve_device(name: Optional[str]) -> torch.device:
    """The device to evaluate on: `name`, or the GPU when torch sees one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SpecdraftError(f"device {name!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdraftError(f"device {name!r}: this torch sees no CUDA device "
                             f"(torch {torch.__version__}, a CPU build or no GPU visible)")
    return device


def make_drafter(method: str, target: nn.Module, draft: Optional[Draft] = None) -> Drafter:
    if method in NEEDS_DRAFT:
        if draft is None:
            raise SpecdraftError(f"method {method!r} needs a draft export")
        return draft.make_drafter(target)
    if method == "prompt_lookup":
        return PromptLookupDrafter()
    if method == "self":
        return ModelDrafter(target, name="self")
    raise SpecdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def run_plain(target: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              temperature: float = 0.0, seed: int = 0, stop: Sequence[int] = ()) -> List[Generation]:
    """Plain target decoding of every prompt (after one untimed warm-up)."""
    generate_plain(target, prompts[0], max_new_tokens=2)
    generator = torch.Generator().manual_seed(seed)
    return [generate_plain(target, p, max_new_tokens=max_new_tokens, temperature=temperature,
                           generator=generator, stop_tokens=stop) for p in prompts]


def run_speculative(target: nn.Module, drafter: Drafter, prompts: Sequence[Sequence[int]], *,
                    gamma: Optional[int] = None, tree: Optional[Sequence[int]] = None, max_new_tokens: int = 64,
                    temperature: float = 0.0, seed: int = 0, stop: Sequence[int] = (),
                    record_tv: bool = False) -> List[Generation]:
    speculative_generate(target, drafter, prompts[0], max_new_tokens=2, gamma=gamma, tree=tree)  # warm-up
    generator = torch.Generator().manual_seed(seed)
    return [speculative_generate(target, drafter, p, max_new_tokens=max_new_tokens, gamma=gamma,
                                 tree=tree, temperature=temperature, generator=generator, stop_tokens=stop,
                                 record_tv=record_tv)
            for p in prompts]


def compare(target: nn.Module, drafter: Drafter, prompts: Sequence[Sequence[int]], *, gamma: Optional[int] = None,
            tree: Optional[Sequence[int]] = None, max_new_tokens: int = 64, temperature: float = 0.0,
            seed: int = 0, stop: Sequence[int] = (),
            baseline: Optional[List[Generation]] = None, record_tv: bool = False) -> Dict[str, Any]:
    """Speculative decoding vs plain decoding on the same prompts -> the report's numbers.

    Pass `baseline` (from run_plain) to reuse one baseline measurement for several drafters.
    record_tv: also report mean TV(p, q) over the checked chain positions (one (gamma, V)
    reduction per round inside the timed loop: well under 1% of a verification pass).
    """
    gamma = drafter.default_depth if gamma is None else gamma
    _check_shape(gamma, tree)
    _warn_if_deeper_than_trained(drafter, len(tree) if tree else gamma, "tree depth" if tree else "gamma")
    if baseline is None:
        baseline = run_plain(target, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=seed, stop=stop)
    generations = run_speculative(target, drafter, prompts, gamma=gamma, tree=tree,
                                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                  stop=stop, record_tv=record_tv)
    report: Dict[str, Any] = {
        "drafter": drafter.name, "gamma": None if tree else gamma, "tree": list(tree) if tree else None,
        "temperature": temperature, "max_new_tokens": max_new_tokens, "prompts": len(prompts),
    }
    report.update(acceptance_stats(generations, len(tree) if tree else gamma))
    report.update(timing_stats(generations, baseline))
    # greedy decoding is deterministic, so lossless means token-identical output
    report["matches_target"] = (all(g.tokens == b.tokens for g, b in zip(generations, baseline))
                                if temperature <= 0 else None)
    return report


def _warn_if_deeper_than_trained(drafter: Drafter, depth: int, what: str) -> None:
    trained = drafter.trained_depth
    if trained is not None and depth > trained:
        log.warning(f"specdraft: warning: {what} {depth} drafts deeper than the {trained} tokens ahead "
                    f"the draft was trained for; positions past {trained} run where training never went")


def _check_shape(gamma: Optional[int], tree: Optional[Sequence[int]]) -> None:
    if tree is not None:
        if not tree or any(int(w) < 1 for w in tree):
            raise SpecdraftError(f"tree widths must be positive integers, got {list(tree)}")
    elif gamma is not None and gamma < 1:
        raise SpecdraftError(f"gamma must be >= 1, got {gamma}")


def evaluate(path, prompts_file, *, method: str = "draft", gamma: Optional[int] = None,
             tree: Optional[Sequence[int]] = None, max_new_tokens: int = 64, temperature: float = 0.0,
             thinking: Optional[bool] = None,
             max_prompts: Optional[int] = None, seed: int = 0, plot_path=None,
             record_tv: bool = False, device: Optional[str] = None, dtype: str = "auto",
             target: Optional[str] = None) -> Dict[str, Any]:
    """Evaluate a run dir (its newest step_<N>/ export), an export dir, or — for the model-free
    methods — a target model dir, on a jsonl prompt file. Returns the report dict.
    target: the target model dir (default: the path the export records).

    gamma None: the depth the draft was trained for. device None: CUDA when there is one.
    dtype "auto": the target's own torch_dtype (config.json); target and draft both run in it.
    thinking: the template's enable_thinking for the prompts, as the training data used (None: its default).
    """
    from specdraft.target.model import load_frozen_target

    if method not in METHODS:
        raise SpecdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if temperature < 0:
        raise SpecdraftError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise SpecdraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check_shape(gamma, tree)
    export_dir, target_dir = resolve_export(path, target)
    if export_dir is None and method in NEEDS_DRAFT:
        raise SpecdraftError(f"{path}: a target model directory, not a draft export; method {method!r} "
                             f"needs a run or export directory")
    tokenizer = load_tokenizer(export_dir, target_dir)
    prompts = read_prompts(prompts_file, tokenizer, max_prompts, thinking)
    target = load_frozen_target(str(target_dir), dtype, resolve_device(device))
    weight = target.get_input_embeddings().weight  # a parameter, or a buffer when held outside ZeRO-3
    draft = None
    if method == "draft":
        draft, _ = load_exported_draft(export_dir, weight.dtype)
    elif method == "untrained":
        draft = draft_from_export_config(read_export_config(export_dir)).cast(weight.dtype).eval()
    if draft is not None:
        draft = draft.to(weight.device)
    torch.manual_seed(seed)
    report = {"method": method, "draft": str(export_dir) if draft is not None else None,
              "target": str(target_dir), "prompts_file": str(prompts_file),
              "device": str(weight.device), "dtype": str(weight.dtype).replace("torch.", "")}
    report.update(compare(target, make_drafter(method, target, draft), prompts, gamma=gamma, tree=tree,
                          max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                          stop=stop_tokens(target, tokenizer), record_tv=record_tv))
    report["plot"] = None
    if plot_path is not None:
        plot_acceptance(report, plot_path)
        report["plot"] = str(plot_path)
    return report


@torch.no_grad()
def measure_tau(target: nn.Module, draft: nn.Module, tokenizer, prompts: Sequence[Union[str, Sequence[int]]],
                gamma: Optional[int] = None, max_new_tokens: int = 32, temperature: float = 0.0,
                seed: int = 0) -> Dict[str, Any]:
    """Chain tau of a (plain, non-DeepSpeed) draft module: for the training loop's evals.

    Greedy at temperature 0; at temperature > 0 speculative sampling from a generator seeded with
    `seed` (the same on every rank), and mean TV(p, q) over the checked positions is reported too.
    prompts: user messages (wrapped with the chat template) or token id lists. The draft is put
    in eval mode for the measurement and its train/eval mode restored afterwards. gamma None:
    the depth the draft was trained for.
    """
    ids = [encode_messages(tokenizer, [{"role": "user", "content": p}]) if isinstance(p, str) else list(p)
           for p in prompts]
    was_training = draft.training
    draft.eval()
    try:
        drafter = make_drafter("draft", target, draft)
        gamma = drafter.default_depth if gamma is None else gamma
        stop = stop_tokens(target, tokenizer)
        generator = torch.Generator().manual_seed(seed)
        generations = [speculative_generate(target, drafter, p, max_new_tokens=max_new_tokens, gamma=gamma,
                                            temperature=temperature, generator=generator, stop_tokens=stop,
                                            record_tv=temperature > 0) for p in ids]
    finally:
        draft.train(was_training)
    stats = acceptance_stats(generations, gamma)
    stats["generated_tokens"] = sum(len(g.tokens) for g in generations)
    return stats
