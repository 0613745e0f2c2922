"""Speculative decoding: lossless greedy, exact sampling, cache bookkeeping, GLIDE at inference.

Tiny random models (hidden 64, 2 layers, vocab 256; vocab 8 for the sampling test) on CPU.
"""

import copy
import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from helpers import random_llama, random_target_for
from specdraft.decode.drafters import ModelDrafter, PromptLookupDrafter
from specdraft.decode.measure import measure_tau
from specdraft.commands.evaluate import evaluate
from specdraft.decode.report import format_report
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.decode.cache import cache_length, forward, keep_positions, new_cache
from specdraft.decode.sampling import probabilities, sample_from
from specdraft.decode.tree import DraftTree, accept_path, chain, chain_tv, verification_inputs
from specdraft.drafts import DraftConfig
from specdraft.drafts.registry import FAMILIES, build_draft
from specdraft.drafts.glide.model import GlideDraft
from specdraft.drafts.glide.decode import GlideDrafter, SlidingWindowCache
from specdraft.errors import SpecdraftError

torch.set_num_threads(1)

VOCAB = 256
WINDOW = 8  # GLIDE's self-attention window in these tests: shorter than the prompts


def tiny_llama(vocab=VOCAB, hidden=64, layers=2, init=0.2, seed=0):
    return random_llama(vocab=vocab, hidden=hidden, layers=layers, init=init, seed=seed)


def glide_for(target, window=WINDOW, seed=0):
    torch.manual_seed(seed)
    cfg = OmegaConf.create(
        dict(
            sliding_window=window,
            max_lag=4,
            final_norm=False,
            anchor_offset=False,
            max_sink_tokens=4,
            max_position_offset=100,
        )
    )
    draft = GlideDraft.from_target_config(target.config, cfg).eval()
    with torch.no_grad():  # random weights of a realistic scale instead of the tiny init
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module")
def noisy(target):
    """The target with noise on its weights: agrees with it often, not always (partial accepts)."""
    model = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    return model


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(0)
    out = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist() for n in (3, 9, 14, 20)]
    motif = torch.randint(0, VOCAB, (5,), generator=generator).tolist()
    out.append(motif * 4)  # a repetitive prompt: prompt lookup has something to find
    return out


# -- the target's verification pass ----------------------------------------------------------


def test_tree_pass_gives_each_node_the_logits_of_its_own_path(target):
    prompt = torch.arange(10, 20)
    cache = new_cache(target)
    forward(target, cache, prompt, torch.arange(10))
    #        root=3 ─┬─ 5 ─┬─ 7 ── 9
    #                │     └─ 8
    #                └─ 6
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 2]))
    ids, positions, visible = verification_inputs(tree, 3, cache_length(cache), torch.device("cpu"))
    assert positions.tolist() == [10, 11, 11, 12, 12, 13]
    logits = forward(target, cache, ids, positions, visible)
    paths = [[3], [3, 5], [3, 6], [3, 5, 7], [3, 5, 8], [3, 5, 7, 9]]
    for row, path in enumerate(paths):
        full = torch.cat([prompt, torch.tensor(path)])
        plain = target(full[None]).logits[0, -1]  # no cache, plain causal forward
        torch.testing.assert_close(logits[row], plain, atol=1e-4, rtol=1e-4)


def test_cache_after_a_rejection_equals_a_fresh_prefill_of_the_accepted_tokens(target):
    """Chain rejected midway (a prefix is kept) and a tree accepted through its second branch
    (entries compacted): the kept cache equals a fresh prefill, every layer, keys and values."""
    prompt = torch.arange(30, 42)
    probe = forward(target, new_cache(target), prompt, torch.arange(len(prompt)))
    root = int(probe[-1].argmax())
    after_root = int(
        forward(target, new_cache(target), torch.cat([prompt, torch.tensor([root])]), torch.arange(len(prompt) + 1))[
            -1
        ].argmax()
    )
    wrong = (after_root + 1) % VOCAB
    drafts = [
        chain([after_root, wrong, 7]),  # accepts node 0, rejects node 1
        DraftTree(torch.tensor([wrong, after_root, 5, 6]), torch.tensor([-1, -1, 1, 1])),  # accepts node 1
    ]
    for draft in drafts:
        cache = new_cache(target)
        forward(target, cache, prompt, torch.arange(len(prompt)))
        n = cache_length(cache)
        ids, positions, visible = verification_inputs(draft, root, n, torch.device("cpu"))
        path, _ = accept_path(draft, probabilities(forward(target, cache, ids, positions, visible), 0.0))
        assert len(path) >= 1 and int(draft.tokens[path[0]]) == after_root
        assert len(path) < len(draft)  # something was rejected
        keep_positions(cache, torch.cat([torch.arange(n + 1), n + 1 + torch.tensor(path)]))

        accepted = torch.cat([prompt, torch.tensor([root]), draft.tokens[path]])
        fresh = new_cache(target)
        forward(target, fresh, accepted, torch.arange(len(accepted)))
        assert cache_length(cache) == len(accepted)
        for kept, ref in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(kept.keys, ref.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kept.values, ref.values, atol=1e-5, rtol=1e-5)


# -- lossless greedy -------------------------------------------------------------------------


def test_plain_greedy_loop_equals_transformers_generate(target, prompts):
    for prompt in prompts[:3]:
        ours = generate_plain(target, prompt, max_new_tokens=12).tokens
        theirs = target.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
        assert ours == theirs[0, len(prompt) :].tolist()


@pytest.mark.parametrize("shape", [dict(gamma=4), dict(tree=[3, 4, 4, 2])], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["self", "noisy", "glide", "prompt_lookup"])
def test_speculative_greedy_is_token_identical_to_target_greedy(kind, shape, target, noisy, prompts):
    drafter = {
        "self": lambda: ModelDrafter(target),
        "noisy": lambda: ModelDrafter(noisy),
        "glide": lambda: GlideDrafter(glide_for(target), target),
        "prompt_lookup": lambda: PromptLookupDrafter(),
    }[kind]()
    accepted = drafted = 0
    for prompt in prompts:
        reference = generate_plain(target, prompt, max_new_tokens=20).tokens
        out = speculative_generate(target, drafter, prompt, max_new_tokens=20, **shape)
        assert out.tokens == reference
        accepted, drafted = accepted + sum(out.accepted), drafted + sum(out.drafted)
    if kind in ("noisy", "prompt_lookup"):  # both acceptances and rejections were exercised
        assert 0 < accepted < drafted


def test_speculative_stops_at_a_stop_token_like_plain_decoding(target, prompts):
    prompt = prompts[1]
    free = generate_plain(target, prompt, max_new_tokens=16).tokens
    stop = free[5]
    expected = free[: free.index(stop) + 1]
    assert generate_plain(target, prompt, max_new_tokens=16, stop_tokens=[stop]).tokens == expected
    for shape in (dict(gamma=4), dict(tree=[2, 2, 2])):
        out = speculative_generate(target, ModelDrafter(target), prompt, max_new_tokens=16, stop_tokens=[stop], **shape)
        assert out.tokens == expected


def test_self_drafting_accepts_every_chain_so_tau_is_gamma_plus_one(target, prompts):
    gamma = 4
    for prompt in prompts:
        out = speculative_generate(target, ModelDrafter(target), prompt, max_new_tokens=25, gamma=gamma)
        assert out.accepted == [gamma] * out.target_forwards
        tau = (sum(out.accepted) + out.target_forwards) / out.target_forwards
        assert tau == gamma + 1


# -- sampling is exact -----------------------------------------------------------------------


def chi2_critical(dof: int) -> float:
    """Upper 0.1% point of chi-square(dof), Wilson-Hilferty approximation (within ~1% for dof >= 3).
    z_0.999 = 3.0902. Check values: dof 7 -> 24.3 (table 24.32), dof 30 -> 59.7 (table 59.70)."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def three_token_joint(target, prompt: list, V: int) -> torch.Tensor:
    """(V**3,) the exact joint p(x1, x2, x3 | prompt) of a vocab-V target, from full forwards."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        pairs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        logits = target(pairs).logits
        p2 = torch.softmax(logits[::V, -2], -1)  # (V, V): p(x2 | x1)
        p3 = torch.softmax(logits[:, -1], -1).view(V, V, V)  # p(x3 | x1, x2)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple:
    """Pearson chi-square of observed counts vs expected probs; cells expected < 5 are pooled."""
    total = counts.sum()
    expected = probs * total
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def test_chi2_critical_values_match_the_table():
    assert chi2_critical(7) == pytest.approx(24.32, rel=0.01)
    assert chi2_critical(30) == pytest.approx(59.70, rel=0.01)


def test_rejection_rule_reproduces_the_target_distribution():
    """accept_path alone, many trials: a sampled chain (q = draft distribution) and a tree of
    deterministic siblings (q = one-hot) both emit tokens distributed as the target's p."""
    V = 6
    generator = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    p2 = torch.softmax(torch.randn(V, V, generator=generator) * 1.5, dim=-1)  # p(x2 | x1)
    q1 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])
    q2 = torch.softmax(torch.randn(V, generator=generator), dim=-1)
    trials = 10000

    first, second = torch.zeros(V), torch.zeros(V, V)
    wrong = torch.zeros(V)  # a rule that forgets the residual: must fail the same test
    for _ in range(trials):
        d1 = sample_from(q1, generator)
        d2 = sample_from(q2, generator)
        draft = chain([d1, d2], torch.stack([q1, q2]))
        target_probs = torch.stack([p1, p2[d1], p2[d2]])
        path, nxt = accept_path(draft, target_probs, generator)
        emitted = draft.tokens[path].tolist() + [nxt]
        first[emitted[0]] += 1
        if path:  # x1 = d1 was accepted: x2 comes from the same round, ~ p2[x1]
            second[emitted[0], emitted[1]] += 1
        u = torch.rand((), generator=generator)
        wrong[d1 if u < min(1.0, float(p1[d1] / q1[d1])) else sample_from(p1, generator)] += 1

    stat, dof = chi2_statistic(first, p1)
    assert stat < chi2_critical(dof), (stat, dof)
    for x1 in range(V):
        if second[x1].sum() > 200:
            stat, dof = chi2_statistic(second[x1], p2[x1])
            assert stat < chi2_critical(dof), (x1, stat, dof)
    stat, dof = chi2_statistic(wrong, p1)
    assert stat > chi2_critical(dof)  # the test has the power to catch a wrong rule

    # three deterministic siblings, the likeliest one last: residuals chain through them
    tree = DraftTree(torch.tensor([4, 2, 0]), torch.tensor([-1, -1, -1]))
    counts = torch.zeros(V)
    for _ in range(trials):
        path, token = accept_path(tree, torch.stack([p1, p1, p1, p1]), generator)
        counts[int(tree.tokens[path[0]]) if path else token] += 1
    stat, dof = chi2_statistic(counts, p1)
    assert stat < chi2_critical(dof), (stat, dof)


def family_drafter(family: str, target, seed: int = 5):
    """A randomly initialised draft of a registered family, sized from the target, as its decoder.
    One draft layer, a rank-8 Markov head (DSpark) and a rank-8 selector over 4 of the 8 tokens
    (DFlash2): exactness does not depend on depth or rank, and 1000 generations per case with the
    default 5 layers cost minutes."""
    torch.manual_seed(seed)
    cfg = DraftConfig(
        type=family, sliding_window=WINDOW, num_layers=1, markov_rank=8, selector_rank=8, selector_top_k=4
    )
    draft = build_draft(OmegaConf.structured(cfg), target.config)
    with torch.no_grad():  # weights of a realistic scale instead of the tiny init
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return draft.eval().make_drafter(target)


# Every drafter speculative decoding can run: the model-free ones and one per registered draft
# family (a new family is covered by registering it).
SAMPLED_DRAFTERS = {
    "model": lambda target: ModelDrafter(
        tiny_llama(vocab=target.config.vocab_size, hidden=32, layers=1, init=0.5, seed=4)
    ),  # a different model
    "prompt_lookup": lambda target: PromptLookupDrafter(),
    **{family: functools.partial(family_drafter, family) for family in FAMILIES},
}


@pytest.mark.parametrize("shape", [dict(gamma=2), dict(tree=[2, 2])], ids=["chain", "tree"])
@pytest.mark.parametrize("drafter_name", list(SAMPLED_DRAFTERS))
def test_speculative_sampling_matches_the_target_distribution_end_to_end(drafter_name, shape):
    """Vocab 8: the first three sampled tokens (x1 from the prefill, x2 x3 from verification
    rounds) of speculative sampling vs their exact joint under the target, chi-square test. A chain
    draws its tokens from the draft's q; a tree offers deterministic siblings."""
    V = 8
    shape_of = dict(vocab=V, hidden=32, layers=1, init=0.5, seed=3)
    target = random_target_for(drafter_name, **shape_of) if drafter_name in FAMILIES else tiny_llama(**shape_of)
    drafter = SAMPLED_DRAFTERS[drafter_name](target)
    prompt = [1, 5, 2, 1, 5]  # repeats itself: prompt lookup finds continuations
    temperature = 1.0
    joint = three_token_joint(target, prompt, V)

    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(V**3)
    accepted = drafted = 0
    for _ in range(1000):
        out = speculative_generate(
            target, drafter, prompt, max_new_tokens=3, temperature=temperature, generator=generator, **shape
        )
        x1, x2, x3 = out.tokens
        counts[(x1 * V + x2) * V + x3] += 1
        accepted, drafted = accepted + sum(out.accepted), drafted + sum(out.drafted)
    assert 0 < accepted < drafted  # both acceptance and the residual resampling were exercised
    stat, dof = chi2_statistic(counts, joint)
    assert dof >= 10
    assert stat < chi2_critical(dof), (stat, dof)


# -- TV(p, q) at the verified positions ------------------------------------------------------


def test_chain_tv_covers_the_accepted_positions_and_the_first_rejected_one():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    draft = chain([1, 2, 1], q)
    assert chain_tv(draft, p, accepted=0) == pytest.approx([0.25])
    assert chain_tv(draft, p, accepted=1) == pytest.approx([0.25, 0.0])
    assert chain_tv(draft, p, accepted=3) == pytest.approx([0.25, 0.0, 1.0])  # all accepted: no bonus row
    # deterministic picks (prompt lookup): q = one-hot(token), TV = 1 - p(token)
    assert chain_tv(chain([0, 2]), p, accepted=1) == pytest.approx([0.5, 0.5])


def test_recorded_tv_is_zero_when_the_draft_is_the_target(target, prompts):
    for prompt in prompts[:3]:
        out = speculative_generate(
            target,
            ModelDrafter(target),
            prompt,
            max_new_tokens=16,
            gamma=3,
            temperature=0.8,
            generator=torch.Generator().manual_seed(0),
            record_tv=True,
        )
        assert len(out.tv) == sum(min(a + 1, d) for a, d in zip(out.accepted, out.drafted))
        assert max(out.tv) < 1e-5
    assert (
        speculative_generate(target, ModelDrafter(target), prompts[0], max_new_tokens=8, gamma=3, temperature=0.8).tv
        == []
    )  # only recorded when asked


def test_acceptance_at_checked_positions_is_one_minus_tv_on_average(target, noisy, prompts):
    """Speculative sampling accepts a checked position with probability 1 - TV(p, q): over many
    positions the accepted count stays within 4 standard deviations of sum(1 - TV)."""
    generator = torch.Generator().manual_seed(1)
    accepted = checked = 0
    tv = []
    for drafter in (ModelDrafter(noisy), GlideDrafter(glide_for(target), target)):
        for prompt in prompts:
            out = speculative_generate(
                target,
                drafter,
                prompt,
                max_new_tokens=40,
                gamma=4,
                temperature=1.0,
                generator=generator,
                record_tv=True,
            )
            accepted += sum(out.accepted)
            checked += sum(min(a + 1, d) for a, d in zip(out.accepted, out.drafted))
            tv += out.tv
    tv = torch.tensor(tv, dtype=torch.float64)
    assert len(tv) == checked > 200
    assert 0.1 < float(tv.mean()) < 0.9  # neither drafter is trivially right or wrong
    expected, std = float((1 - tv).sum()), float((tv * (1 - tv)).sum().sqrt())
    assert abs(accepted - expected) < 4 * std, (accepted, expected, std)


def test_measure_tau_at_a_temperature_reports_tv(target, noisy, run_dir):
    from transformers import AutoTokenizer

    root, draft = run_dir
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    greedy = measure_tau(target, draft, tokenizer, [[5, 6, 7, 8]], gamma=3, max_new_tokens=8)
    sampled = measure_tau(target, draft, tokenizer, [[5, 6, 7, 8]], gamma=3, max_new_tokens=8, temperature=0.7, seed=1)
    again = measure_tau(target, draft, tokenizer, [[5, 6, 7, 8]], gamma=3, max_new_tokens=8, temperature=0.7, seed=1)
    assert greedy["mean_tv"] is None and 0.0 <= sampled["mean_tv"] <= 1.0
    assert sampled == again  # seeded: every rank measures the same thing


# -- GLIDE at inference ----------------------------------------------------------------------


def glide_reference_logits(draft, target, tokens, n):
    """The draft over the whole sequence without any cache: queries at indices >= n read the
    target's K/V up to n - 1 (what the cache holds), earlier ones up to their index - 1."""
    ids = torch.tensor(tokens)[None]
    index = torch.arange(len(tokens))
    with torch.no_grad():
        cache = new_cache(target)
        forward(target, cache, ids[0, :n], torch.arange(n))
        keys, values = cache.layers[-1].keys, cache.layers[-1].values
        embeds = target.get_input_embeddings()(ids)
        cos, sin = target.model.rotary_emb(embeds, index[None])
        limit = torch.where(index < n, index - 1, torch.full_like(index, n - 1))
        hidden = draft(embeds, cos, sin, keys, values, limit, index, cache=None)
        return draft.logits(hidden, target.lm_head.weight)[0]  # (T, V)


def test_glide_drafter_with_its_window_cache_equals_a_cacheless_forward(target):
    """Rounds of different accepted lengths, prompt longer than the window: the cached chain
    and tree drafts match a from-scratch draft forward with the inference lag (cross limit n-1)."""
    draft = glide_for(target)
    drafter = GlideDrafter(draft, target)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (13,), generator=generator)  # x_0..x_12; cache holds 0..11
    cache = new_cache(target)
    forward(target, cache, tokens[:-1], torch.arange(len(tokens) - 1))
    drafter.start()
    gamma = 4
    for advance in [1, 3, 5, 2, 4, 1]:
        n = cache_length(cache)
        proposal = drafter.propose_chain(tokens, cache, gamma, 1.0, generator)
        drafted = proposal.tokens.tolist()
        reference = glide_reference_logits(draft, target, tokens.tolist() + drafted[:-1], n)
        torch.testing.assert_close(proposal.q, torch.softmax(reference[n:], -1), atol=1e-5, rtol=1e-4)

        tree = drafter.propose_tree(tokens, cache, [3, 3, 2])
        depth = tree.depth
        for node in range(len(tree)):
            path, walk = [], node
            while walk >= 0:
                path.insert(0, int(tree.tokens[walk]))
                walk = int(tree.parents[walk])
            ref = F.log_softmax(glide_reference_logits(draft, target, tokens.tolist() + path[:-1], n)[n:], -1)
            score = sum(float(ref[d, tok]) for d, tok in enumerate(path))
            assert depth[node] == len(path)
            assert tree.scores[node].item() == pytest.approx(score, abs=1e-4)

        # the target "accepts" `advance` tokens: extend its cache, roll the drafter back
        new = torch.randint(0, VOCAB, (advance,), generator=generator)
        forward(target, cache, torch.cat([tokens[-1:], new[:-1]]), torch.arange(n, n + advance))
        tokens = torch.cat([tokens, new])
        drafter.rollback(cache_length(cache))


def test_glide_self_attention_cache_never_exceeds_the_sliding_window(target, prompts, monkeypatch):
    sizes = []
    original = SlidingWindowCache.append

    def spy(self, keys, values, index):
        out = original(self, keys, values, index)
        sizes.append(self.keys.shape[2])
        assert len(self) == self.keys.shape[2] == self.values.shape[2]
        return out

    monkeypatch.setattr(SlidingWindowCache, "append", spy)
    drafter = GlideDrafter(glide_for(target), target)
    long_prompt = prompts[3] + prompts[2]  # 34 tokens, window 8
    for shape in (dict(gamma=5), dict(tree=[4, 4, 4])):
        out = speculative_generate(target, drafter, long_prompt, max_new_tokens=20, **shape)
        assert len(out.tokens) == 20
        assert len(drafter.cache) <= WINDOW
    assert sizes and max(sizes) == WINDOW  # the window was reached, never passed


# -- prompt lookup ---------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    drafter = PromptLookupDrafter(max_ngram=2)
    tokens = torch.tensor([7, 1, 2, 3, 4, 9, 1, 2, 5, 1, 2])
    # "1 2" occurred twice before: after it came 3 4 9 1 and 5 1 2; the longer one first
    assert drafter.propose_chain(tokens, None, 4, 0.0, None).tokens.tolist() == [3, 4, 9, 1]
    # three tokens deep both continuations are full length: the latest (5 1 2) comes first, and
    # depth 3 has room for one node only
    tree = drafter.propose_tree(tokens, None, [2, 2, 1])
    assert tree.tokens.tolist() == [5, 3, 1, 4, 2]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]
    assert len(drafter.propose_chain(torch.tensor([1, 2, 3]), None, 4, 0.0, None)) == 0


# -- evaluate / measure_tau ------------------------------------------------------------------


def write_char_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(["<bos>", "<eos>", "<pad>"] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, target):
    """A target dir and a run dir with two exports (the newest has the real weights)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("eval")
    target_dir = root / "target"
    target.save_pretrained(str(target_dir))
    write_char_tokenizer(target_dir)
    draft = glide_for(target)
    for step, weights in ((3, glide_for(target, seed=9)), (10, draft)):
        export = root / "run" / f"step_{step}"
        export.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.state_dict().items()}, str(export / "model.safetensors"))
        (export / "config.json").write_text(json.dumps(dict(weights.export_config(), target={"path": str(target_dir)})))
    (root / "run" / "step_11.tmp").mkdir()  # an unfinished export is never picked
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "def add(a, b):"})
        + "\n\n"
        + json.dumps(
            {
                "conversations": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "again"},
                    {"role": "assistant", "content": "x"},
                ]
            }
        )
        + "\n"
    )
    return root, draft


def test_evaluate_reports_tau_acceptance_and_speedup(run_dir, tmp_path):
    root, _ = run_dir
    plot = tmp_path / "acceptance.png"
    report = evaluate(root / "run", root / "prompts.jsonl", gamma=3, max_new_tokens=8, plot_path=plot)
    assert report["draft"].endswith("step_10")
    assert report["matches_target"] is True
    assert report["prompts"] == 2 and len(report["acceptance_per_position"]) == 3
    assert report["tau"] == pytest.approx(
        (report["accepted_tokens"] + report["target_forwards"]) / report["target_forwards"]
    )
    assert report["speedup"] > 0 and plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    json.dumps(report)
    table = format_report(report)
    assert "tau" in table and "speedup" in table

    tree = evaluate(
        root / "run" / "step_3", root / "prompts.jsonl", tree=[2, 2], max_new_tokens=8, method="prompt_lookup"
    )
    assert tree["tree"] == [2, 2] and tree["matches_target"] is True and tree["draft"] is None
    self_report = evaluate(root / "target", root / "prompts.jsonl", method="self", gamma=3, max_new_tokens=8)
    assert self_report["tau"] >= 3.0  # the last round may stop early at the tokenizer's eos


def test_eval_shows_a_bar_per_phase_and_skips_the_target_alone_when_asked(run_dir, monkeypatch, capsys):
    """Each phase moves its own bar once per prompt (target alone, then speculative); with
    --no-baseline the target alone never runs, tau and acceptance are the same numbers, and the
    table says the speedup was not measured."""
    from specdraft import cli
    from specdraft.decode import measure

    root, _ = run_dir
    bars = []

    class Bar:
        def __init__(self, what, total):
            self.what, self.total, self.n, self.closed = what, total, 0, False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    args = dict(gamma=3, max_new_tokens=8)
    full = evaluate(root / "run", root / "prompts.jsonl", progress=Bar, **args)
    assert [(b.what, b.total, b.n, b.closed) for b in bars] == [
        ("target alone", 2, 2, True),
        (f"speculative ({full['drafter']})", 2, 2, True),
    ]

    def no_target_alone(*a, **k):
        raise AssertionError("the target alone was timed")

    monkeypatch.setattr(measure, "run_plain", no_target_alone)
    bars.clear()
    quick = evaluate(root / "run", root / "prompts.jsonl", baseline=False, progress=Bar, **args)
    assert [b.what for b in bars] == [f"speculative ({full['drafter']})"]
    same = ("tau", "accepted_tokens", "target_forwards", "acceptance_per_position", "generated_tokens")
    assert {k: quick[k] for k in same} == {k: full[k] for k in same}
    assert quick["speedup"] is None and quick["baseline_tokens_per_second"] is None
    assert quick["matches_target"] is None  # nothing to compare with
    assert (
        cli.main(
            [
                "eval",
                str(root / "run"),
                "--prompts",
                str(root / "prompts.jsonl"),
                "--gamma",
                "3",
                "--max-new-tokens",
                "8",
                "--no-baseline",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "speedup                           not measured (--no-baseline)" in table
    assert "target alone" not in table and "output == target greedy" not in table


def test_evaluate_names_the_bad_line_of_a_prompt_file(run_dir, tmp_path):
    root, _ = run_dir
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(SpecdraftError, match=r"bad\.jsonl:2"):
        evaluate(root / "run", bad)
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(SpecdraftError, match=r"bad\.jsonl:2"):
        evaluate(root / "run", bad)
    with pytest.raises(SpecdraftError, match="needs a run or export"):
        evaluate(root / "target", root / "prompts.jsonl", method="draft")
    with pytest.raises(SpecdraftError, match="no step_"):
        evaluate(tmp_path, root / "prompts.jsonl")


def test_eval_renders_the_prompts_with_the_thinking_setting(run_dir, tmp_path, monkeypatch):
    """`specdraft eval --thinking on|off` reaches the chat template as enable_thinking, as in the data."""
    import shutil

    import specdraft.commands.evaluate as evaluate_module
    from specdraft.cli import main

    root, _ = run_dir
    export = tmp_path / "export"
    shutil.copytree(root / "run" / "step_10", export)
    tokenizer = write_char_tokenizer(export)  # the export's tokenizer wins over the target's
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
        "not enable_thinking %}<think></think>{% endif %}{% endif %}"
    )
    tokenizer.save_pretrained(str(export))
    seen = []
    real_compare = evaluate_module.compare
    monkeypatch.setattr(
        evaluate_module,
        "compare",
        lambda target, drafter, prompts, **kw: (
            seen.append(["".join(tokenizer.convert_ids_to_tokens(p)) for p in prompts]),
            real_compare(target, drafter, prompts, **kw),
        )[1],
    )
    for thinking in ("off", "on", None):
        assert (
            main(
                [
                    "eval",
                    str(export),
                    "--prompts",
                    str(root / "prompts.jsonl"),
                    "--max-prompts",
                    "1",
                    "--max-new-tokens",
                    "2",
                    "--gamma",
                    "1",
                    "--json",
                ]
                + (["--thinking", thinking] if thinking else [])
            )
            == 0
        )
    assert seen == [
        ["<user>def add(a, b):\n<assistant><think></think>"],
        ["<user>def add(a, b):\n<assistant>"],
        ["<user>def add(a, b):\n<assistant>"],
    ]


def test_measure_tau_for_the_training_loop(run_dir, target):
    from transformers import AutoTokenizer

    root, draft = run_dir
    tokenizer = AutoTokenizer.from_pretrained(str(root / "target"))
    draft.train()
    result = measure_tau(target, draft, tokenizer, ["def f(x):", [5, 6, 7, 8]], gamma=3, max_new_tokens=8)
    assert draft.training  # mode restored
    assert result["tau"] >= 1.0 and len(result["acceptance_per_position"]) == 3


# -- every family's drafter on the accepted path ------------------------------------------------


@pytest.mark.parametrize("shape", [dict(gamma=3), dict(tree=[3, 2, 2])], ids=["chain", "tree"])
def test_every_familys_drafter_gets_tokens_accepted_and_stays_lossless(shape):
    """A random draft of each registered family over an 8-token vocabulary gets tokens accepted
    (and rejected), so cache compaction and the hidden-state hand-over after an acceptance run;
    greedy output stays the target's own."""
    from specdraft.drafts import DraftConfig
    from specdraft.drafts.registry import FAMILIES

    small = {
        "eagle3": {"draft_vocab_size": 8},
        "dflash": {"num_layers": 1, "block_size": 4},
        "dspark": {"num_layers": 1, "block_size": 4, "markov_rank": 4},
    }
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 8, (n,), generator=generator).tolist() for n in (1, 5, 11)]
    for family, cls in FAMILIES.items():
        target = random_target_for(family, vocab=8, hidden=32, init=0.5, max_positions=256)
        draft = cls.from_target_config(
            target.config, OmegaConf.structured(DraftConfig(type=family, **small.get(family, {})))
        )
        if hasattr(draft, "set_vocab_maps"):  # EAGLE-3: the whole vocabulary, identity maps
            draft.set_vocab_maps(torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool))
        with torch.no_grad():
            for p in draft.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        drafter = draft.eval().make_drafter(target)
        accepted = drafted = 0
        for prompt in prompts:
            out = speculative_generate(target, drafter, prompt, max_new_tokens=24, **shape)
            assert out.tokens == generate_plain(target, prompt, max_new_tokens=24).tokens, family
            accepted, drafted = accepted + sum(out.accepted), drafted + sum(out.drafted)
        print(f"{family}: {accepted} of {drafted} drafted tokens accepted")
        assert 0 < accepted < drafted, (family, accepted, drafted)
