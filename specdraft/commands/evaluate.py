"""`specdraft eval`: tau, acceptance per position and speedup of a draft export on a prompt file.

    report = evaluate("runs/x", "prompts.jsonl")      # newest runs/x/step_<N>/, gamma: as trained
    print(format_report(report))                                     # specdraft.decode.report

Methods: "draft" (the exported draft), "untrained" (a freshly built draft of the same dims),
"prompt_lookup" (n-gram lookup, no model), "self" (the target drafting for itself: tau's ceiling).
Speedup is against plain target decoding of the same prompts, measured in the same call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from specdraft.decode.measure import METHODS, NEEDS_DRAFT, check_shape, compare, make_drafter
from specdraft.decode.prompts import read_prompts, stop_tokens
from specdraft.decode.report import plot_acceptance, require_matplotlib
from specdraft.drafts.registry import draft_from_export_config
from specdraft.errors import SpecdraftError
from specdraft.rundir.ownership import check_plot_file
from specdraft.target.model import load_frozen_target, load_target_tokenizer
from specdraft.target.checks import has_tokenizer
from specdraft.export.files import load_exported_draft, read_export_config
from specdraft.export.locate import resolve_export


def load_tokenizer(export_dir: Optional[Path], target_dir: Path):
    """The export's tokenizer (it carries the target's), else the target's."""
    return load_target_tokenizer(export_dir if export_dir is not None and has_tokenizer(export_dir) else target_dir)


def resolve_device(name: Optional[str]) -> torch.device:
    """The device to evaluate on: `name`, or the GPU when torch sees one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SpecdraftError(f"device {name!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdraftError(
            f"device {name!r}: this torch sees no CUDA device "
            f"(torch {torch.__version__}, a CPU build or no GPU visible)"
        )
    return device


def evaluate(
    path,
    prompts_file,
    *,
    method: str = "draft",
    gamma: Optional[int] = None,
    tree: Optional[Sequence[int]] = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    thinking: Optional[bool] = None,
    max_prompts: Optional[int] = None,
    seed: int = 0,
    plot_path=None,
    record_tv: bool = False,
    device: Optional[str] = None,
    dtype: str = "auto",
    target: Optional[str] = None,
    confidence_threshold: Optional[float] = None,
    draft_name: Optional[str] = None,
    baseline: bool = True,
    progress=None,
) -> Dict[str, Any]:
    """Evaluate a run dir (its newest step_<N>/ export), an export dir, or — for the model-free
    methods — a target model dir, on a jsonl prompt file. Returns the report dict.
    target: the target model dir (default: the path the export records).

    gamma None: the depth the draft was trained for. device None: CUDA when there is one.
    dtype "auto": the target's own torch_dtype (config.json) on a GPU, fp32 on the CPU (a CPU
    without native bf16, AVX2 only, runs a bf16 matmul ~47x slower); target and draft both run in it.
    thinking: the template's enable_thinking for the prompts, as the training data used (None: its default).
    confidence_threshold: a draft with a confidence head stops a block at the first slot below it
    (None: the draft's own default, draft.confidence_threshold). baseline False: the target alone
    is not timed (no speedup, no lossless check). progress: decode.measure's Progress (a bar per
    phase, moved per prompt).
    """

    if method not in METHODS:
        raise SpecdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if temperature < 0:
        raise SpecdraftError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise SpecdraftError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_shape(gamma, tree)
    if plot_path is not None:
        require_matplotlib()
    if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
        raise SpecdraftError(f"--confidence-threshold: must be in [0, 1], got {confidence_threshold}")
    if plot_path is not None:  # before the target is loaded
        check_plot_file(plot_path)
    export_dir, target_dir = resolve_export(path, target, draft_name)
    if export_dir is None and method in NEEDS_DRAFT:
        raise SpecdraftError(
            f"{path}: a target model directory, not a draft export; method {method!r} needs a run or export directory"
        )
    tokenizer = load_tokenizer(export_dir, target_dir)
    prompts = read_prompts(prompts_file, tokenizer, max_prompts, thinking)
    device = resolve_device(device)
    if dtype == "auto" and device.type == "cpu":
        dtype = "fp32"
    target = load_frozen_target(str(target_dir), dtype, device)
    weight = target.get_input_embeddings().weight  # a parameter, or a buffer when held outside ZeRO-3
    draft = None
    if method == "draft":
        draft, _ = load_exported_draft(export_dir, weight.dtype)
    elif method == "untrained":
        draft = draft_from_export_config(read_export_config(export_dir)).cast(weight.dtype).eval()
    if draft is not None:
        draft = draft.to(weight.device)
    torch.manual_seed(seed)
    report = {
        "method": method,
        "draft": str(export_dir) if draft is not None else None,
        "target": str(target_dir),
        "prompts_file": str(prompts_file),
        "device": str(weight.device),
        "dtype": str(weight.dtype).replace("torch.", ""),
    }
    drafter = make_drafter(method, target, draft)
    if confidence_threshold is not None:
        if not hasattr(drafter, "confidence_threshold"):  # a family without a confidence head
            raise SpecdraftError(
                f"--confidence-threshold: the {getattr(draft, 'label', None) or method} drafter "
                f"has no confidence head (DSpark drafts have one)"
            )
        drafter.confidence_threshold = confidence_threshold
        report["confidence_threshold"] = confidence_threshold
    report.update(
        compare(
            target,
            drafter,
            prompts,
            gamma=gamma,
            tree=tree,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            stop=stop_tokens(target, tokenizer),
            record_tv=record_tv,
            measure_baseline=baseline,
            progress=progress,
        )
    )
    report["plot"] = None
    if plot_path is not None:
        drafter_label = getattr(draft, "label", None) or method.replace("_", " ")
        plot_acceptance(
            [(drafter_label, report)],
            plot_path,
            title=f"{drafter_label}, {'tree' if tree else 'chain'}, T = {temperature:g}: tau = {report['tau']:.2f}",
        )
        report["plot"] = str(plot_path)
    return report
