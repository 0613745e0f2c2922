"""Sequence parallelism (issue 34): sequence_parallel_size, the capture without a (T, T) mask, every
family at SP=2 on 2 CPU ranks (gloo) against one rank, resume across SP sizes."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import REPO, one_rank_env, random_llama, run_overrides, torchrun
from specdraft.config import load_config
from specdraft.errors import SpecdraftError
from specdraft.target.capture import CaptureRequest
from specdraft.train.loop import train
from specdraft.train.model import target_features

TOLERANCE = 1e-5  # relative, losses
# relative, gradients: the worst parameter's max |difference| over its max |gradient|, fp32 sums in
# another order on two shards (DSpark with every slot predicting, gpt_oss's windows: 1.0025e-5)
GRAD_TOLERANCE = 2e-5


# -- config ---------------------------------------------------------------------------------------


def test_sequence_parallel_size_is_refused_where_it_cannot_work(tiny_target_dir, data_dir, tmp_path):
    def load(**extra):
        return load_config(
            None, run_overrides(tiny_target_dir, data_dir, tmp_path / "run", tmp_path / "cache", **extra)
        )

    from specdraft.target.model import load_target_config

    heads = load_target_config(str(tiny_target_dir)).num_attention_heads
    with pytest.raises(SpecdraftError, match=r"sequence_parallel_size': 3 does not divide max_seq_length 64"):
        load(sequence_parallel_size=3)
    with pytest.raises(SpecdraftError, match=r"sequence_parallel_size': must be >= 1, got 0"):
        load(sequence_parallel_size=0)
    bad = heads * 2 if 64 % (heads * 2) == 0 else None
    if bad:
        with pytest.raises(SpecdraftError, match=rf"{bad} does not divide the target's {heads} attention heads"):
            load(sequence_parallel_size=bad)
    assert load(sequence_parallel_size=2).sequence_parallel_size == 2
    assert load(sequence_parallel_size=2, **{"draft.type": "peagle"}).sequence_parallel_size == 2
    # a rank reads the next rank's first num_depths / ttt_steps tokens: at most a shard (16 / 4 = 4)
    with pytest.raises(
        SpecdraftError,
        match=r"key 'draft.num_depths': 8 reads past the next rank's tokens at "
        r"sequence_parallel_size 4 \(max_seq_length / 4 = 4 each\)",
    ):
        load(sequence_parallel_size=4, max_seq_length=16, **{"draft.type": "peagle"})
    with pytest.raises(SpecdraftError, match=r"key 'draft.ttt_steps': 7 reads past"):
        load(sequence_parallel_size=4, max_seq_length=16, **{"draft.type": "eagle3"})
    assert (
        load(
            sequence_parallel_size=4, max_seq_length=16, **{"draft.type": "peagle", "draft.num_depths": 4}
        ).draft.num_depths
        == 4
    )


def test_mtp_under_sequence_parallelism_is_one_line_and_exit_2(tiny_target_dir, data_dir, tmp_path, capsys):
    """MTP fine-tunes the target's own MTP layer (transformers' decoder layer class, no head
    exchange; Qwen3-Next's linear-attention layers the sharded capture does not run): refused
    before anything is written."""
    from specdraft.cli import main

    overrides = run_overrides(
        tiny_target_dir,
        data_dir,
        tmp_path / "run",
        tmp_path / "cache",
        sequence_parallel_size=2,
        **{"draft.type": "mtp"},
    )
    (tmp_path / "run.yaml").write_text("{}\n")
    assert main(["train", str(tmp_path / "run.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        "key 'sequence_parallel_size': draft.type mtp does not train on sequence shards: its layer is the "
        "target's own decoder layer class (no head exchange), and Qwen3-Next's linear-attention layers do not "
        "run in the sharded capture (families that do: glide, eagle3, dflash, dspark, peagle, dflash2)"
    ) in err
    assert not (tmp_path / "run").exists()


def test_windowed_layers_shard_and_linear_attention_layers_are_refused():
    """A window applies over the whole sequence after the head exchange (the sharded capture and
    every family's loss at SP=2 on gpt-oss and Gemma 3: below); a Gated DeltaNet layer's state
    runs token by token through the whole sequence and is refused."""
    from transformers import Gemma3TextConfig, GptOssConfig, Qwen3NextConfig

    from specdraft.parallel.checks import sequence_parallel_refusal

    shape = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    windowed = ["sliding_attention", "full_attention"] * 2
    for config in (GptOssConfig(layer_types=windowed, **shape), Gemma3TextConfig(layer_types=windowed, **shape)):
        assert sequence_parallel_refusal(2, 64, config) is None
    hybrid = Qwen3NextConfig(layer_types=["linear_attention", "full_attention"] * 2, **shape)
    assert sequence_parallel_refusal(2, 64, hybrid) == (
        "the target has linear_attention layers (layer_types): their state runs through the whole sequence "
        "in order, so its capture is not sharded (sequence parallelism shards attention only)"
    )
    assert sequence_parallel_refusal(1, 64, hybrid) is None


def test_heads_and_kv_heads_that_sp_does_not_divide_are_named():
    from specdraft.parallel.checks import sequence_parallel_refusal

    config = random_llama(vocab=32, hidden=48, heads=6, kv_heads=3).config
    assert "does not divide the target's 6 attention heads" in sequence_parallel_refusal(4, 64, config)
    assert "the target's 3 key/value heads and 2 do not divide one another" in sequence_parallel_refusal(2, 64, config)
    assert sequence_parallel_refusal(3, 63, config) is None  # 3 kv heads, 1 per rank
    assert sequence_parallel_refusal(6, 60, config) is None  # 3 kv heads, each read by 2 ranks


def test_a_world_size_sp_does_not_divide_is_one_line(tiny_target_dir, data_dir, tmp_path, monkeypatch):
    for key, value in one_rank_env().items():
        monkeypatch.setenv(key, value)
    cfg = load_config(
        None,
        run_overrides(
            tiny_target_dir, data_dir, tmp_path / "run", tmp_path / "cache", sequence_parallel_size=2, max_steps=1
        ),
    )
    with pytest.raises(SpecdraftError, match=r"sequence_parallel_size': 2 does not divide the world size 1"):
        train(cfg, log=lambda *a: None)
    assert not (tmp_path / "run").exists()  # refused before anything was written


# -- no (T, T) mask -------------------------------------------------------------------------------


class LargestSquare(TorchDispatchMode):
    """Records every op output whose last two dims are both >= T (a (T, T) mask or score)."""

    def __init__(self, T):
        super().__init__()
        self.T, self.seen = T, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and min(t.shape[-2:]) >= self.T:
                self.seen.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("packed", [False, True])
def test_the_capture_allocates_no_sequence_by_sequence_tensor(packed):
    target = random_llama(vocab=96, layers=2, hidden=64)
    T = 160  # above every width of the model (hidden 64, MLP 128): only a (T, T) tensor is that wide
    ids = torch.randint(0, 96, (2, T))
    documents = torch.cat([torch.zeros(2, 70, dtype=torch.long), torch.ones(2, T - 70, dtype=torch.long)], 1)
    request = CaptureRequest(layers=(1,), last_layer_kv=True, final_hidden=True)
    with LargestSquare(T) as mode:
        target_features(target.model, request, ids, document_ids=documents if packed else None)
    assert mode.seen == []
    # the same recorder sees transformers' own mask, which the old capture built
    from transformers.masking_utils import create_causal_mask

    with LargestSquare(T) as mode:
        create_causal_mask(
            config=target.config,
            inputs_embeds=torch.empty(2, T, 0),
            attention_mask=None,
            past_key_values=None,
            position_ids=None,
            and_mask_function=lambda b, h, q, kv: documents[b, q] == documents[b, kv],
        )
    assert mode.seen


# -- 2 ranks (gloo): SP=2 against 1 rank --------------------------------------------------------


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "model.json"
    proc = torchrun(REPO / "tests" / "sp_script.py", out, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_results(sp_results):
    return sp_results["model"]


@pytest.mark.parametrize(
    "family,objective",
    [(f, o) for f in ("glide", "eagle3", "dflash", "dspark", "peagle", "dflash2") for o in ("ce", "kl")]
    + [(f, o) for f in ("eagle3", "peagle") for o in ("lk_alpha", "lk_lambda")]
    # windowed targets (sp_script.WINDOWED: window 8 across the shard border)
    + [(f"gpt_oss/{f}", "ce") for f in ("glide", "eagle3", "dflash", "dspark", "peagle", "dflash2")]
    + [(f"gemma3_text/{f}", "ce") for f in ("glide", "eagle3", "peagle")],
)
def test_every_family_at_sp2_equals_one_rank_loss_and_gradients(model_results, family, objective):
    r = model_results[f"{family}/{objective}"]
    alone, shared = r["loss"]
    assert shared == pytest.approx(alone, rel=TOLERANCE)
    assert r["tokens"][0] == r["tokens"][1] and r["correct"][0] == r["correct"][1]
    assert r["grad_rel"] <= GRAD_TOLERANCE
    assert r["grad_nonzero"] == r["params"]  # every parameter learns (no gradient lost in an exchange)


@pytest.mark.parametrize("family", ["glide", "eagle3", "peagle", "dflash", "dspark"])
def test_the_memory_model_holds_what_the_busiest_rank_holds_at_sp2(sp_results, family):
    """The live tensor bytes of one training step on the rank that holds the most (sp_script.py's
    memory part) against the model's terms above weights, gradients and optimizer state, at SP=1
    and SP=2 on the same batch. One conversation per row: within 10% at both sizes (GLIDE longer
    than two windows: its band mask spans the whole sequence on every rank; DFlash and DSpark with
    every trained token in rank 0's half: that rank holds every anchor, the case the model
    bounds, and the other rank's padding is not counted). Packed rows: EAGLE-3, P-EAGLE, GLIDE
    within 10% too; DFlash and DSpark attend per conversation on CPU, cheaper than the dense
    block mask the model counts: at most 10% over, at most 20% under. DSpark one conversation a row:
    at most 15% under, the model counting each block slot's loss-chunk temporaries beside the
    slots' markov_w2 gradients (V x r fp32 each, made in the forward since 2026-11-28; measured
    0.886 at SP=1, where the recomputing backward it replaced measured 0.905)."""
    one = 0.85 if family == "dspark" else 0.90
    for rows, low in (("one", one), ("packed", 0.90 if family not in ("dflash", "dspark") else 0.80)):
        for size in ("1", "2"):
            case = sp_results["memory"][f"{family}/{rows}"][size]
            ratio = max(case["ranks"]) / case["model"]
            assert low <= ratio <= 1.10, (rows, size, ratio, case)
    if family in ("dflash", "dspark"):  # the rank without trained tokens runs one padding block
        one = sp_results["memory"][f"{family}/one"]["2"]["ranks"]
        assert one[1] < one[0] / 4, one


def test_the_gather_returns_a_permuted_gradient_to_its_rank(model_results):
    """torch's all_gather backward off NCCL scrambled a dense non-contiguous gradient (P-EAGLE's
    gathered keys, from SDPA's backward); SequenceShard.gather's own sums it over the group."""
    assert model_results["gather/permuted_gradient"] == 0.0


@pytest.fixture(scope="module")
def resume_runs(tiny_target_dir, tmp_path_factory):
    """1 rank SP=1 straight; 2 ranks SP=2 (straight, and resumed at step 4 at the same size); 1 rank
    SP=1 resumed from SP=2's step 4 (saved at 6); 2 ranks SP=2 resumed from the 1-rank run's own
    step 4 slot (see sp_script.train_part), and from that SP=1 run's step 6 (the chain)."""
    from helpers import write_chat_files

    work = tmp_path_factory.mktemp("sp_train")
    write_chat_files(work / "data")

    def one_rank(name, *extra, family="eagle3"):
        overrides = run_overrides(
            tiny_target_dir,
            work / "data",
            work / name,
            work / "cache",
            max_steps=8,
            save_steps=4,
            per_device_batch_size=2,
            **{"draft.type": family},
        )
        return train(load_config(None, overrides + list(extra)), log=lambda *a: None).losses

    runs = {"sp1": one_rank("sp1"), "peagle_sp1": one_rank("peagle_sp1", family="peagle")}
    out = work / "train.json"
    proc = torchrun(
        REPO / "tests" / "sp_script.py",
        out,
        tiny_target_dir,
        work / "data",
        work,
        work / "sp1" / "ckpt" / "step_4",
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs.update(json.loads(out.read_text())["train"])
    # saved at 6 too: the chain's last hop resumes from it at SP=2
    runs["sp2_to_sp1"] = one_rank("sp2_to_sp1", f"resume={work}/sp2/ckpt/step_4", "save_steps=2")
    chain = work / "chain.json"
    proc = torchrun(
        REPO / "tests" / "sp_script.py",
        chain,
        tiny_target_dir,
        work / "data",
        work,
        work / "sp2_to_sp1" / "ckpt" / "step_6",
        "chain",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs.update(json.loads(chain.read_text())["train"])
    runs["peagle_sp2_to_sp1"] = one_rank("peagle_sp2_to_sp1", f"resume={work}/peagle_sp2/ckpt/step_4", family="peagle")
    return runs


def _close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=TOLERANCE)


def test_training_at_sp2_on_two_ranks_follows_one_rank(resume_runs):
    _close(resume_runs["sp2"], resume_runs["sp1"])


def test_sp2_resumes_exactly_at_the_same_size(resume_runs):
    assert resume_runs["sp2_resumed"] == resume_runs["sp2"][4:]


def test_peagle_at_sp2_follows_one_rank_and_resumes_at_sp1(resume_runs):
    """P-EAGLE's COD slots are drawn from the loop's batch generator over the whole sequence, so
    SP=2 on 2 ranks trains the slots of the 1-rank run, and its checkpoint continues at SP=1."""
    _close(resume_runs["peagle_sp2"], resume_runs["peagle_sp1"])
    _close(resume_runs["peagle_sp2_to_sp1"], resume_runs["peagle_sp1"][4:])


def test_a_run_resumes_across_sp_sizes(resume_runs):
    """The draft's states are not sharded by SP (every rank of a group holds the whole draft):
    SP=2 -> SP=1 and SP=1 -> SP=2 continue the straight run."""
    _close(resume_runs["sp2_to_sp1"], resume_runs["sp1"][4:])
    _close(resume_runs["sp1_to_sp2"], resume_runs["sp1"][4:])


def test_one_run_goes_sp2_then_sp1_then_sp2_and_follows_the_straight_run(resume_runs):
    """One chain: 2 ranks at SP=2 (steps 1-4), 1 rank at SP=1 resumed from it (5-6, saved at 6),
    2 ranks at SP=2 resumed from that (7-8): each hop's losses are the straight run's."""
    _close(resume_runs["sp2"][:4], resume_runs["sp1"][:4])
    _close(resume_runs["sp2_to_sp1"][:2], resume_runs["sp1"][4:6])
    _close(resume_runs["chain_sp2"], resume_runs["sp1"][6:])
