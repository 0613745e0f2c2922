"""An EAGLE-3 draft saved by speculators' own classes (`Eagle3DraftModel.save_pretrained`, in the
speculators venv: its names, its config, the verifier's tensors it carries) imports through
`draft.init_from`, and our draft then computes speculators' own logits over three TTT steps."""

import torch
from transformers import AutoModelForCausalLM

from speculators_env import run_in_speculators
from specdraft.train.export import write_draft_export
from specdraft.train.imports import read_init_from
from specdraft.drafts import build_draft
from test_eagle3_export import assert_speculators_computes_our_logits, random_eagle3, run_cfg, target_dir  # noqa: F401

RESAVE = r"""
import json, sys, torch
from safetensors import safe_open
from speculators.models.eagle3 import Eagle3DraftModel

source, out = sys.argv[1], sys.argv[2]
model = Eagle3DraftModel.from_pretrained(source)
generator = torch.Generator().manual_seed(7)
with torch.no_grad():  # new draft weights of its own; the verifier's tensors stay the verifier's
    for name, p in model.named_parameters():
        if name.split(".")[0] in ("fc", "layers", "norm", "lm_head"):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1 if p.dim() == 2 else torch.rand(p.shape, generator=generator) + 0.5)
model.save_pretrained(out)
with safe_open(out + "/model.safetensors", "pt") as f:
    print(json.dumps({"saved": sorted(f.keys())}))
"""


def test_a_draft_speculators_saved_imports_and_computes_its_logits(target_dir, tmp_path):  # noqa: F811
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cfg = run_cfg(target_dir, tmp_path, draft_vocab_size=100)
    ours = random_eagle3(target, cfg)
    export = write_draft_export(tmp_path / "step_1", ours.state_dict(), ours, cfg)
    report = run_in_speculators(RESAVE, export / "speculators", tmp_path / "theirs")
    cfg.draft.init_from = str(tmp_path / "theirs")
    imported = read_init_from(cfg, target.config)
    assert imported.fmt == "speculators"
    draft = build_draft(cfg.draft, target.config)
    draft.load_state_dict(imported.state, strict=True)
    draft.eval()
    assert set(imported.state) == set(draft.state_dict()) and set(imported.state) <= set(report["saved"])
    assert not torch.equal(draft.fc.weight, ours.fc.weight)  # speculators' new weights, not ours
    assert torch.equal(draft.d2t, ours.d2t) and torch.equal(draft.t2d, ours.t2d)
    assert_speculators_computes_our_logits(target, draft, tmp_path / "theirs", tmp_path)
