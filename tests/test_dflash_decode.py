"""DFlash in the speculative decoding loop: lossless greedy (chain and tree), exact sampling, and
the drafter's context always equal to what the target verified.

Tiny random Llama targets (vocab 16 / 8) so that a random DFlash draft is accepted some of the time.
"""

import pytest
import torch
from omegaconf import OmegaConf

from helpers import random_llama
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.drafts import DraftConfig
from specdraft.drafts.dflash.model import DFlashDraft
from test_decode import chi2_critical, chi2_statistic, three_token_joint

torch.set_num_threads(1)


def tiny_target(vocab, hidden=32, layers=2, init=0.5, seed=0):
    return random_llama(vocab=vocab, hidden=hidden, layers=layers, init=init, seed=seed, max_positions=256)


def dflash_for(target, seed=0, **overrides):
    cfg = OmegaConf.structured(DraftConfig(**{"type": "dflash", "num_layers": 1, "block_size": 4, **overrides}))
    draft = DFlashDraft.from_target_config(target.config, cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return draft.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target(16)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 16, (int(n),), generator=generator).tolist() for n in (1, 4, 9, 15)]


@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("shape", [dict(gamma=5), dict(gamma=2), dict(tree=[3, 2, 2])], ids=["chain", "chain2", "tree"])
def test_dflash_greedy_is_token_identical_to_target_greedy(target, prompts, shape, sample_from_anchor):
    drafter = dflash_for(target, sample_from_anchor=sample_from_anchor).make_drafter(target)
    accepted = drafted = 0
    for prompt in prompts:
        reference = generate_plain(target, prompt, max_new_tokens=24).tokens
        out = speculative_generate(target, drafter, prompt, max_new_tokens=24, **shape)
        assert out.tokens == reference
        # one block per round: min(gamma, its predictions) tokens, or a tree at most that deep
        depth = drafter.layout.predictions
        if "gamma" in shape:
            assert set(out.drafted) == {min(shape["gamma"], depth)}
        else:
            assert max(out.drafted) <= sum(shape["tree"][:depth])
        # the drafter's context is exactly what the target verified (all but the newest token)
        assert drafter.length == len(prompt) + sum(out.accepted) + out.target_forwards
        accepted, drafted = accepted + sum(out.accepted), drafted + sum(out.drafted)
    assert 0 < accepted < drafted  # acceptances and rejections were both exercised


def test_dflash_sampling_matches_the_target_distribution_end_to_end():
    """Vocab 8: the first three sampled tokens of speculative sampling with a DFlash drafter (chain
    of sampled slots, and a tree of deterministic picks) against their exact joint under the target."""
    V = 8
    target = tiny_target(V, layers=1, seed=3)
    prompt = [1, 5, 2]
    joint = three_token_joint(target, prompt, V)
    generator = torch.Generator().manual_seed(0)
    drafter = dflash_for(target, seed=4, target_layers=[1]).make_drafter(target)
    for shape in (dict(gamma=2), dict(tree=[2, 2])):
        counts = torch.zeros(V**3)
        for _ in range(1000):
            out = speculative_generate(
                target, drafter, prompt, max_new_tokens=3, temperature=1.0, generator=generator, **shape
            )
            x1, x2, x3 = out.tokens
            counts[(x1 * V + x2) * V + x3] += 1
        stat, dof = chi2_statistic(counts, joint)
        assert dof >= 10
        assert stat < chi2_critical(dof), (shape, stat, dof)
