"""DFlash2's blocks equal speculators 0.9.0's own (models/dflash2/model_definitions.py and
metrics.py), run in its venv on the same weights and inputs: the grouped dynamic convolution
(random kernels, several blocks per row, taps that would cross a block border), the candidate
selector's scores, and the training candidates with a label outside the top-K."""

import pytest
import torch

from specdraft.drafts.dflash2.conv import GroupedDynamicCausalConv
from specdraft.drafts.dflash2.selector import CandidateSelector, select_path, training_candidates
from speculators_env import run_in_speculators

SPECULATORS_BLOCKS = r"""
import json, sys
import torch
from speculators.models.dflash2.model_definitions import CandidateSelector, GroupedDynamicCausalConv
from speculators.models.dflash2.metrics import selector_training_candidates

case = torch.load(sys.argv[1], weights_only=True)
B, N, H = case["x"].shape
conv = GroupedDynamicCausalConv(H, block_size=case["block"], kernel_size=case["K"], group_size=case["G"])
conv.load_state_dict(case["conv"])
with torch.no_grad():
    prepared, kernel = conv.prepare(case["x"].reshape(1, B * N, H))  # its rows flattened, as it trains
    finished = conv.finish(case["y"].reshape(1, B * N, H), kernel)
V, R = case["selector"]["predecessor_codebook"].shape
selector = CandidateSelector(vocab_size=V, hidden_size=H, rank=R, top_k=case["top_k"])
selector.load_state_dict(case["selector"])
with torch.no_grad():
    ids, scores = selector.select(case["unary"], case["hidden"], case["predecessors"])
trained, positions, contains = selector_training_candidates(ids, case["targets"])
torch.save(dict(prepared=prepared.reshape(B, N, H), finished=finished.reshape(B, N, H), ids=ids, scores=scores,
                trained=trained, positions=positions, contains=contains), sys.argv[2])
print(json.dumps({"ok": True}))
"""


@pytest.mark.parametrize("kernel_size,group_size", [(2, 16), (3, 8)])
def test_the_blocks_compute_what_speculators_computes(tmp_path, kernel_size, group_size):
    g = torch.Generator().manual_seed(kernel_size)
    B, block, H, V, R, top_k = 2, 4, 32, 50, 6, 5
    N = 3 * block
    conv = GroupedDynamicCausalConv(H, block, kernel_size, group_size)
    with torch.no_grad():  # away from the identity: taps and dynamic kernels both count
        conv.base_kernel.normal_(generator=g)
        conv.kernel_projection.weight.normal_(std=0.3, generator=g)
    selector = CandidateSelector(V, H, R, top_k)
    x, y = torch.randn(B, N, H, generator=g), torch.randn(B, N, H, generator=g)
    unary, hidden = torch.randn(B, N, V, generator=g), torch.randn(B, N, H, generator=g)
    predecessors = torch.randint(0, V, (B, N), generator=g)
    targets = unary.argmax(-1)
    targets[0, :3] = unary[0, :3].argmin(-1)  # labels the unary top-K misses
    case = dict(
        x=x,
        y=y,
        block=block,
        K=kernel_size,
        G=group_size,
        conv=conv.state_dict(),
        selector=selector.state_dict(),
        top_k=top_k,
        unary=unary,
        hidden=hidden,
        predecessors=predecessors,
        targets=targets,
    )
    torch.save(case, tmp_path / "case.pt")
    run_in_speculators(SPECULATORS_BLOCKS, tmp_path / "case.pt", tmp_path / "theirs.pt")
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    with torch.no_grad():
        prepared, kernel = conv.prepare(x)
        finished = conv.finish(y, kernel)
        ids = unary.topk(top_k, dim=-1).indices
        scores = selector.score_candidates(unary, hidden, predecessors, ids)
    torch.testing.assert_close(prepared, theirs["prepared"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(finished, theirs["finished"], rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, theirs["ids"])
    torch.testing.assert_close(scores, theirs["scores"], rtol=1e-5, atol=1e-6)
    trained, positions, contains = training_candidates(ids, targets)
    assert torch.equal(trained, theirs["trained"]) and torch.equal(positions, theirs["positions"])
    assert torch.equal(contains, theirs["contains"]) and not contains[0, :3].any()


def test_a_fresh_convolution_is_the_identity_and_no_tap_crosses_a_block_border():
    conv = GroupedDynamicCausalConv(16, block_size=4, kernel_size=3, group_size=4)
    x = torch.randn(2, 8, 16)
    prepared, kernel = conv.prepare(x)
    assert torch.equal(prepared, x) and torch.equal(conv.finish(x, kernel), x)
    with torch.no_grad():
        conv.base_kernel.zero_()
        conv.base_kernel[0, 2].fill_(1.0)  # y_s = x_{s-2} where slot s >= 2, else 0
    prepared, _ = conv.prepare(x)
    slots = torch.arange(8) % 4
    assert torch.equal(prepared[:, slots < 2], torch.zeros_like(prepared[:, slots < 2]))
    assert torch.equal(prepared[:, slots >= 2], x[:, torch.arange(8)[slots >= 2] - 2])


def test_the_path_walks_from_the_anchor_on_its_own_picks():
    """Greedy: each slot's predecessor is the previous slot's pick; q is one-hot on it. Sampled: q
    is softmax over the slot's K candidates and the token one of them."""
    torch.manual_seed(0)
    S, V, H = 4, 30, 8
    selector = CandidateSelector(V, H, 4, top_k=3, initializer_range=1.0)
    unary, hidden = torch.randn(S, V), torch.randn(S, H)
    tokens, q = select_path(selector, unary, hidden, anchor=7)
    previous = torch.tensor(7)
    for s in range(S):
        candidates = unary[s].topk(3).indices
        scores = selector.score_candidates(unary[s], hidden[s], previous, candidates)
        previous = candidates[scores.argmax()]
        assert tokens[s] == previous and q[s, previous] == 1.0 and q[s].sum() == 1.0
    tokens, q = select_path(
        selector, unary, hidden, anchor=7, temperature=0.7, generator=torch.Generator().manual_seed(1)
    )
    for s in range(S):
        candidates = unary[s].topk(3).indices
        assert tokens[s] in candidates and q[s, tokens[s]] > 0
        assert torch.isclose(q[s].sum(), torch.tensor(1.0)) and int((q[s] > 0).sum()) <= 3
