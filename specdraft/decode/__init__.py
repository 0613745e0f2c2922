"""Speculative decoding against the frozen target: drafters, verification, evaluation reports.

    sampling.py     one sampler for draft and target; the accept / resample rule
    tree.py         draft trees (a chain is a tree), the tree attention mask, path acceptance
    cache.py        target forward passes over a position-indexed KV cache; keep / crop entries
    drafters.py     GlideDrafter, ModelDrafter ("self"), PromptLookupDrafter
    speculative.py  speculative_generate (chain or tree) and generate_plain
    report.py       tau, acceptance per position, speedup; terminal table; PNG plot
    evaluate.py     evaluate() behind `specdraft eval`, measure_tau() for training evals
"""

from specdraft.decode.drafters import Drafter, GlideDrafter, ModelDrafter, PromptLookupDrafter
from specdraft.decode.evaluate import METHODS, evaluate, measure_tau, read_prompts
from specdraft.decode.report import format_report, plot_acceptance
from specdraft.decode.speculative import Generation, generate_plain, speculative_generate

__all__ = ["Drafter", "GlideDrafter", "ModelDrafter", "PromptLookupDrafter", "METHODS", "evaluate",
           "measure_tau", "read_prompts", "format_report", "plot_acceptance", "Generation",
           "generate_plain", "speculative_generate"]
