"""draft.gradient_checkpointing: the same loss and gradients, fewer activations kept, for every
family that offers it (GLIDE is one layer: checkpointing it would recompute all and save nothing,
so it is not one of its keys)."""

import pytest
import torch
from omegaconf import OmegaConf

from helpers import random_target_for
from specdraft.config import DraftConfig
from specdraft.drafts import family_keys
from specdraft.drafts.registry import FAMILIES, build_draft
from specdraft.drafts.base import MemoryShape
from specdraft.drafts.eagle3.vocab import vocab_maps
from specdraft.train.model import TargetWithDraft

SMALL = {
    "eagle3": dict(draft_vocab_size=64, ttt_steps=3),
    "dflash": dict(num_layers=2, block_size=4, max_anchors=6),
    "dspark": dict(num_layers=2, block_size=4, max_anchors=6),
    "dflash2": dict(num_layers=2, block_size=4, max_anchors=6, selector_rank=8, selector_top_k=4),
    "mtp": dict(num_speculative_steps=3),
}
OFFERING = sorted(f for f, cls in FAMILIES.items() if "gradient_checkpointing" in family_keys(cls))


def test_the_families_with_several_layer_passes_offer_it():
    assert OFFERING == ["dflash", "dflash2", "dspark", "eagle3", "mtp"]


def draft_for(family, target, checkpointing, small=True):
    torch.manual_seed(1)
    sizes = SMALL[family] if small else {}
    cfg = OmegaConf.structured(DraftConfig(type=family, gradient_checkpointing=checkpointing, **sizes))
    draft = build_draft(cfg, target.config)
    if family == "eagle3":  # the draft vocab: the most frequent ids of made-up counts
        draft.set_vocab_maps(*vocab_maps(torch.arange(128, 0, -1).numpy(), draft.dims.draft_vocab_size))
    return draft.train()


@pytest.mark.parametrize("family", OFFERING)
def test_loss_and_gradients_are_those_without_it_and_the_layers_are_recomputed(family, monkeypatch):
    target = random_target_for(family, vocab=128, layers=4)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    results = {}
    original = torch.utils.checkpoint.checkpoint
    for checkpointing in (False, True):
        draft = draft_for(family, target, checkpointing)
        calls = []
        monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or original(*a, **k))
        out = TargetWithDraft(target, draft, loss_chunk_size=16)(ids, mask, anchor_seed=3)
        out.loss.backward()
        results[checkpointing] = (
            out.loss.detach(),
            {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None},
            len(calls),
        )
    (plain, plain_grads, plain_calls), (ckpt, ckpt_grads, ckpt_calls) = results[False], results[True]
    assert plain_calls == 0 and ckpt_calls > 0
    torch.testing.assert_close(ckpt, plain, rtol=0, atol=1e-6)
    assert plain_grads.keys() == ckpt_grads.keys() and plain_grads
    for name in plain_grads:
        torch.testing.assert_close(ckpt_grads[name], plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", OFFERING)
def test_the_memory_model_counts_fewer_activations_with_it(family):
    target = random_target_for(family, vocab=128, layers=4)
    shape = MemoryShape(B=1, T=4096, dtype_bytes=2, chunk=1024, documents=False, target=target.config)
    kept = {c: draft_for(family, target, c, small=False).memory_terms(shape) for c in (False, True)}
    assert kept[True]["draft activations"] < 0.8 * kept[False]["draft activations"]


def test_glide_refuses_it_in_one_line():
    from specdraft.drafts import check_family_keys
    from specdraft.errors import SpecdraftError

    with pytest.raises(SpecdraftError, match="'draft.gradient_checkpointing': not a key of draft.type 'glide'") as err:
        check_family_keys(FAMILIES["glide"], ["gradient_checkpointing"])
    assert "\n" not in str(err.value)


def test_it_trains_under_zero3_with_the_losses_of_a_run_without_it(tiny_target_dir, data_dir, tmp_path):
    """Non-reentrant checkpointing recomputes inside DeepSpeed's ZeRO-3 parameter gathering."""
    from helpers import train_run

    eagle3 = {"draft.type": "eagle3", "draft.ttt_steps": 2, "draft.draft_vocab_size": 200}
    losses = {
        c: train_run(
            tiny_target_dir,
            data_dir,
            tmp_path,
            f"ckpt{c}",
            zero_stage=3,
            max_steps=3,
            save_steps=3,
            **eagle3,
            **{"draft.gradient_checkpointing": c},
        ).losses
        for c in (False, True)
    }
    assert len(losses[True]) == 3
    assert max(abs(a - b) for a, b in zip(losses[True], losses[False])) <= 1e-5, losses
