"""Speculative decoding against the frozen target: drafters, verification, evaluation reports.

    sampling.py     one sampler for draft and target; the accept / resample rule
    tree.py         draft trees (a chain is a tree), the tree attention mask, path acceptance
    cache.py        target forward passes over a position-indexed KV cache; keep / crop entries
    drafters.py     the Drafter interface, tree growth, ModelDrafter ("self"), PromptLookupDrafter
    speculative.py  speculative_generate (chain or tree) and generate_plain
    report.py       tau, acceptance per position, speedup; terminal table; PNG plot
    evaluate.py     evaluate() behind `specdraft eval`, measure_tau() for training evals

A trained draft's Drafter comes from its family in specdraft.drafts (`draft.make_drafter(target)`);
those import this package's drafters/cache/tree modules, and evaluate.py imports specdraft.drafts,
so this __init__ stays empty of imports: `from specdraft.decode.evaluate import evaluate`.
"""
