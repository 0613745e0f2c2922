"""Speculative decoding against the frozen target: drafters, verification, evaluation reports.

    sampling.py     one sampler for draft and target; the accept / resample rule
    tree.py         draft trees (a chain is a tree), the tree attention mask, path acceptance
    cache.py        target forward passes over a position-indexed KV cache; keep / crop entries
    drafters.py     the Drafter interface, tree growth, ModelDrafter ("self"), PromptLookupDrafter
    speculative.py  speculative_generate (chain or tree) and generate_plain
    report.py       tau, acceptance per position, speedup; terminal table; PNG plot
    prompts.py      prompt files and chat messages -> token ids; end-of-turn ids
    measure.py      a drafter against plain decoding: compare(), measure_tau() for training evals

This package is the engine below the families: it never imports specdraft.drafts or train. A
trained draft's Drafter comes from its family (`draft.make_drafter(target)`), which builds it from
this package's drafters/cache/tree modules. `specdraft eval` is specdraft/commands/evaluate.py.
"""
