"""`draft.lm_head` of EAGLE-3 and P-EAGLE: `own` (a random start, trained), `target` (the target's
lm_head rows of the draft vocab as the start, trained) and `target_frozen` (those rows, never
trained: speculators 0.9.0's head, speculators/model.py load_verifier_weights, which copies
lm_head_weight[t2d] and sets requires_grad False). Pinned: the rows a new head starts from, a frozen
head that training, resume and export leave equal to them while the rest learns, and a trained
head that moves."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from helpers import train_run
from specdraft.cli import main
from specdraft.config import DraftConfig
from specdraft.drafts.eagle3.vocab import vocab_maps
from specdraft.drafts.registry import build_draft
from specdraft.export.files import load_exported_draft

FAMILIES = {
    "eagle3": {"draft.type": "eagle3", "draft.ttt_steps": 2, "draft.draft_vocab_size": 200},
    "peagle": {"draft.type": "peagle", "draft.num_depths": 2, "draft.draft_vocab_size": 200},
}


def target_rows(target_dir, draft) -> torch.Tensor:
    """The target's lm_head rows of the draft vocab, read by transformers: row d is target id d + d2t[d]."""
    head = AutoModelForCausalLM.from_pretrained(target_dir).get_output_embeddings().weight.detach()
    return head[torch.arange(draft.dims.draft_vocab_size) + draft.d2t]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("source", ["own", "target", "target_frozen"])
def test_a_new_head_starts_where_lm_head_says_and_only_target_frozen_freezes_it(served_target_dir, family, source):
    target = AutoModelForCausalLM.from_pretrained(served_target_dir)
    options = {key.split(".", 1)[1]: value for key, value in FAMILIES[family].items() if key != "draft.type"}
    cfg = OmegaConf.structured(DraftConfig(type=family, lm_head=source, **options))
    draft = build_draft(cfg, target.config)
    counts = torch.randint(0, 1000, (target.config.vocab_size,), generator=torch.Generator().manual_seed(0))
    draft.set_vocab_maps(*vocab_maps(counts.numpy(), 200))
    start = draft.lm_head.weight.detach().clone()
    draft.adopt_target_weights(target.lm_head.weight, fresh=True)
    rows = target_rows(served_target_dir, draft)
    if source == "own":
        assert torch.equal(draft.lm_head.weight, start) and not torch.equal(start, rows)
    else:
        assert torch.equal(draft.lm_head.weight, rows)
    assert draft.lm_head.weight.requires_grad == (source != "target_frozen")

    # a resumed or imported head keeps its weights; target_frozen still freezes it
    again = build_draft(cfg, target.config)
    kept = again.lm_head.weight.detach().clone()
    again.adopt_target_weights(target.lm_head.weight, fresh=False)
    assert torch.equal(again.lm_head.weight, kept)
    assert again.lm_head.weight.requires_grad == (source != "target_frozen")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_frozen_head_stays_the_targets_rows_through_training_resume_and_export(
    served_target_dir, data_dir, tmp_path, family
):
    keys = dict(FAMILIES[family], **{"draft.lm_head": "target_frozen"})
    train_run(served_target_dir, data_dir, tmp_path, "run", max_steps=2, save_steps=2, **keys)
    first, _ = load_exported_draft(tmp_path / "run" / "step_2")
    rows = target_rows(served_target_dir, first)
    assert torch.equal(first.lm_head.weight, rows)

    resumed = train_run(served_target_dir, data_dir, tmp_path, "run", max_steps=3, save_steps=2, **keys)
    assert len(resumed.losses) == 1
    last, _ = load_exported_draft(tmp_path / "run" / "step_3")
    assert torch.equal(last.lm_head.weight, rows)
    assert not torch.equal(last.fc.weight, first.fc.weight)  # the rest of the draft learns

    # a trained head from the same start moves off the target's rows
    moving = dict(FAMILIES[family], **{"draft.lm_head": "target"})
    train_run(served_target_dir, data_dir, tmp_path, "moving", max_steps=2, save_steps=2, **moving)
    trained, _ = load_exported_draft(tmp_path / "moving" / "step_2")
    assert torch.equal(trained.d2t, first.d2t) and not torch.equal(trained.lm_head.weight, rows)

    # an imported head is kept, not restarted from the target's rows, and frozen
    imported = dict(moving, **{"draft.lm_head": "target_frozen", "draft.init_from": tmp_path / "moving" / "step_2"})
    train_run(served_target_dir, data_dir, tmp_path, "imported", max_steps=1, save_steps=1, **imported)
    kept, _ = load_exported_draft(tmp_path / "imported" / "step_1")
    assert torch.equal(kept.lm_head.weight, trained.lm_head.weight)
    assert not torch.equal(kept.fc.weight, trained.fc.weight)


def test_an_unknown_lm_head_is_one_line(tiny_target_dir, data_dir, tmp_path, capsys):
    from helpers import run_overrides

    args = run_overrides(tiny_target_dir, data_dir, tmp_path / "bad", tmp_path / "cache", max_steps=1)
    (tmp_path / "run.yaml").write_text("seed: 3\n")
    code = main(["train", str(tmp_path / "run.yaml"), *args, "draft.type=eagle3", "draft.lm_head=verifier"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "key 'draft.lm_head': must be one of own | target | target_frozen, got 'verifier'" in err
    assert "\n" not in err and not (tmp_path / "bad").exists()
