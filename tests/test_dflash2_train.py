"""DFlash2's loss and drafter: the selector's weight enters the loss linearly (its term is
selector_loss_alpha x the K-way cross-entropy, nothing else moves with it), and the drafter's
greedy chain is the selector's path from the anchor over the block's unary logits."""

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from helpers import realistic_block_draft, random_llama
from specdraft.drafts import DraftConfig
from specdraft.drafts.base import LossBatch
from specdraft.drafts.dflash2.model import DFlash2Draft
from specdraft.drafts.dflash2.selector import select_path
from specdraft.target.capture import capture

torch.set_num_threads(1)
VOCAB, T = 64, 24


def make_draft(target, **overrides):
    keys = dict(type="dflash2", num_layers=1, block_size=4, max_anchors=5, selector_rank=8, selector_top_k=4)
    cfg = OmegaConf.structured(DraftConfig(**{**keys, **overrides}))
    DFlash2Draft.validate_config(cfg, target.config, "test", max_seq_length=T)
    draft = DFlash2Draft.from_target_config(target.config, cfg)
    realistic_block_draft(draft)
    return draft


def test_the_selector_term_is_alpha_times_its_cross_entropy():
    target = random_llama(vocab=VOCAB, layers=2, max_positions=64, init=0.02)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(2))
    losses, selector = {}, {}
    for alpha in (0.0, 1.0, 2.0):
        draft = make_draft(target, selector_loss_alpha=alpha)
        feats = capture(target.model, ids, torch.arange(T).expand(2, T), draft.capture_request())
        out = draft.training_loss(
            LossBatch(feats, target.lm_head.weight, ids, torch.ones_like(ids), options={"anchor_seed": 3})
        )
        losses[alpha] = float(out.loss.detach())
        value, count = out.metrics["selector/loss"]
        selector[alpha] = (float(value), int(count))
    assert selector[0.0] == selector[1.0] == selector[2.0] and selector[1.0][0] > 0
    step = losses[1.0] - losses[0.0]
    assert step > 0 and abs((losses[2.0] - losses[0.0]) - 2 * step) <= 1e-5 * abs(losses[2.0])


def test_the_greedy_chain_is_the_selectors_path_from_the_anchor():
    target = random_llama(vocab=VOCAB, layers=2, max_positions=64, init=0.5).eval()
    draft = make_draft(target, selector_top_k=4).eval()
    with torch.no_grad():  # a selector strong enough that the predecessor decides between candidates
        for p in draft.candidate_selector.parameters():
            p.mul_(6.0)
    drafter = draft.make_drafter(target)
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = target(prompt[:, :-1], past_key_values=DynamicCache(), use_cache=True, output_hidden_states=True)
        hidden = {layer: out.hidden_states[layer][0] for layer in draft.dims.target_layers}
        drafter.observe_target(hidden, 0)
        tree = drafter.propose_chain(prompt[0], out.past_key_values, 3, 0.0, None)
        n, anchor = prompt.shape[1] - 1, int(prompt[0, -1])
        block = drafter.block_hidden(anchor, n)[0]
        unary = draft.block_head(block[None], None, drafter.head_weight).logits()[0].float()
        first = draft.layout.first_slot
        tokens, _ = select_path(draft.candidate_selector, unary[first:], block[first:], anchor)
        previous = torch.tensor(anchor)  # the sensitivity this test needs: the anchor alone picks otherwise
        candidates = unary[first:].topk(4, dim=-1).indices
        scores = draft.candidate_selector.score_candidates(
            unary[first:], block[first:], previous.expand(candidates.shape[0]), candidates
        )
    assert tree.tokens.tolist() == tokens[:3].tolist()
    anchor_only = candidates.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
    assert anchor_only[:3].tolist() != tokens[:3].tolist()
