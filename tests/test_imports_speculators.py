"""Drafts saved by speculators' own classes (`Eagle3DraftModel` / `DFlashDraftModel.save_pretrained`,
in the speculators venv: its names, its config, the verifier's tensors it carries) import through
`draft.init_from`, and our draft then computes speculators' own logits (EAGLE-3 over three TTT
steps, DFlash over whole blocks)."""

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from helpers import imported_draft, random_llama, save_target
from speculators_env import run_in_speculators, run_speculators_file
from specdraft.config import TrainConfig
from specdraft.drafts.dflash.export import write_speculators_export
from specdraft.export.files import write_draft_export
from test_dflash_export import REPO, VOCAB, make_draft, our_logits
from test_eagle3_export import assert_speculators_computes_our_logits, random_eagle3, run_cfg, target_dir  # noqa: F401

RESAVE = r"""
import json, sys, torch
from safetensors import safe_open
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.dflash import DFlashDraftModel

source, out, kind = sys.argv[1], sys.argv[2], sys.argv[3]
model = {"eagle3": Eagle3DraftModel, "dflash": DFlashDraftModel}[kind].from_pretrained(source)
generator = torch.Generator().manual_seed(7)
with torch.no_grad():  # new draft weights of its own; the verifier's tensors stay the verifier's
    for name, p in model.named_parameters():
        if name.split(".")[0] in ("fc", "layers", "norm", "lm_head", "hidden_norm"):
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
    report = run_in_speculators(RESAVE, export / "speculators", tmp_path / "theirs", "eagle3")
    cfg.draft.init_from = str(tmp_path / "theirs")
    imported, draft = imported_draft(cfg, target.config)
    assert imported.fmt == "speculators"
    draft.eval()
    assert set(imported.state) == set(draft.state_dict()) and set(imported.state) <= set(report["saved"])
    assert not torch.equal(draft.fc.weight, ours.fc.weight)  # speculators' new weights, not ours
    assert torch.equal(draft.d2t, ours.d2t) and torch.equal(draft.t2d, ours.t2d)
    assert_speculators_computes_our_logits(target, draft, tmp_path / "theirs", tmp_path)


def test_a_dflash_speculators_saved_imports_and_computes_its_logits(tmp_path):
    directory = save_target(random_llama(vocab=VOCAB, layers=4, max_positions=256, init=0.02), tmp_path / "target")
    target = LlamaForCausalLM.from_pretrained(directory).eval().requires_grad_(False)
    ours = make_draft(target, block_size=5)
    write_speculators_export(ours, ours.state_dict(), tmp_path / "spec", str(directory))
    run_in_speculators(RESAVE, tmp_path / "spec", tmp_path / "theirs", "dflash")
    cfg = OmegaConf.structured(TrainConfig(target=str(directory), data_files="unused"))
    cfg.draft = OmegaConf.merge(
        cfg.draft, dict(type="dflash", num_layers=2, block_size=5, init_from=str(tmp_path / "theirs"))
    )
    _, draft = imported_draft(cfg, target.config)
    draft.eval()
    assert not torch.equal(draft.fc.weight, ours.fc.weight)  # speculators' new weights
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    anchors = torch.tensor([2, 10, 21, 30])
    logits, feats = our_logits(draft, target, ids, anchors)
    hidden_states = torch.cat([feats.hidden[i] for i in draft.dims.target_layers], dim=-1)
    torch.save({"anchors": anchors, "input_ids": ids, "hidden_states": hidden_states}, tmp_path / "in.pt")
    run_speculators_file(
        REPO / "tests" / "speculators_dflash_check.py", tmp_path / "theirs", tmp_path / "in.pt", tmp_path / "out.pt"
    )
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["weights_equal"]
    torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-4)
