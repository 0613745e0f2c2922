"""draft.type mtp: fine-tuning a target's native MTP layer (speculators' MTPDraftModel).

The target is a tiny qwen3_next with an MTP layer stored as Qwen's checkpoints store it
(helpers.qwen3_next_mtp_target). Proven here: the new draft IS the target's MTP layer; speculators'
own classes load our export and compute our per-step logits and our loss; which token each
recursive step reads and predicts; training lowers the loss; the stitched target holds every
tensor it should; decoding with it is lossless; a target without an MTP layer is refused in one line.
"""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import REPO, qwen3_next_mtp_target, run_overrides, train_run
from speculators_env import run_speculators_file
from specdraft.drafts.base import LossBatch
from specdraft.cli import main
from specdraft.decode.speculative import generate_plain, speculative_generate
from specdraft.drafts import DraftConfig
from specdraft.drafts.registry import build_draft
from specdraft.drafts.mtp.export import VLLM_METHOD, write_speculators, write_stitched
from specdraft.drafts.mtp.train import step_weights
from specdraft.errors import SpecdraftError
from specdraft.target.capture import capture
from specdraft.target.model import load_frozen_target, load_target_config

torch.set_num_threads(1)
T = 40


def mtp_cfg(**overrides):
    return OmegaConf.structured(DraftConfig(**{"type": "mtp", **overrides}))


@pytest.fixture(scope="module")
def target(mtp_target_dir):
    return load_frozen_target(str(mtp_target_dir))


def new_draft(target_dir, **overrides):
    return build_draft(mtp_cfg(**overrides), load_target_config(str(target_dir))).eval()


def perturbed(draft, seed=1, scale=0.05):
    """The draft moved off the target's layer (a trained draft is not the target's)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return draft


def batch(seed=3, length=T):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (1, length), generator=generator)
    mask = (torch.rand(1, length, generator=generator) > 0.3).long()
    return ids, mask


# -- the target's own layer --------------------------------------------------------------------


def test_the_new_draft_is_the_targets_own_mtp_layer(mtp_target_dir):
    """Every mtp.* tensor of the target's file, in our (speculators') names: the four renamed
    modules, the decoder layer's tensors, and the per-expert weights fused as transformers holds
    them (gate_up_proj[i] = [gate_i; up_i], down_proj[i] = down_i)."""
    state = new_draft(mtp_target_dir).state_dict()
    with safe_open(str(mtp_target_dir / "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    renamed = {
        "mtp.fc.weight": "input_proj.weight",
        "mtp.norm.weight": "final_layernorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "hidden_layernorm.weight",
        "mtp.pre_fc_norm_embedding.weight": "token_layernorm.weight",
    }
    checked = set()
    for key, value in stored.items():
        if ".experts." in key:
            index, proj = key.split(".experts.")[1].split(".")[:2]
            index = int(index)
            gate_up, down = state["mtp_layers.0.mlp.experts.gate_up_proj"], state["mtp_layers.0.mlp.experts.down_proj"]
            half = gate_up.shape[1] // 2
            got = {"gate_proj": gate_up[index, :half], "up_proj": gate_up[index, half:], "down_proj": down[index]}[proj]
            checked.update({"mtp_layers.0.mlp.experts.gate_up_proj", "mtp_layers.0.mlp.experts.down_proj"})
        else:
            name = "mtp_layers.0." + (renamed.get(key) or key[len("mtp.layers.0.") :])
            got = state[name]
            checked.add(name)
        assert torch.equal(got, value), key
    assert checked == set(state)  # and the draft has nothing else


def test_speculators_loads_the_export_and_computes_our_logits_and_loss(mtp_target_dir, target, tmp_path):
    """speculators' MTPDraftModel.from_pretrained (its embeddings and lm_head read from the
    verifier, our target) loads every tensor of our export, and its forward's per-step logits and
    weighted loss (step weights beta = 0.6) equal ours; its MTPConverter extracts from the target
    exactly the state our new draft starts from."""
    draft = perturbed(new_draft(mtp_target_dir))
    initial = new_draft(mtp_target_dir).state_dict()
    write_speculators(draft, draft.state_dict(), tmp_path / "spec", str(mtp_target_dir))
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["num_nextn_predict_layers"] == 1
    ids, mask = batch()
    features = capture(target.model, ids, torch.arange(T)[None], draft.capture_request())
    with torch.no_grad():
        outputs = draft.unroll(features.final_hidden, features.input_embeds, features.cos, features.sin)
        ours = draft.training_loss(LossBatch(features, target.lm_head.weight, ids, mask, 0))
    torch.save({"input_ids": ids, "hidden_states": features.final_hidden, "loss_mask": mask}, tmp_path / "in.pt")
    run_speculators_file(
        REPO / "tests" / "speculators_mtp_check.py",
        tmp_path / "spec",
        mtp_target_dir,
        tmp_path / "in.pt",
        tmp_path / "out.pt",
    )
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["unexpected"] == [] and result["mismatched"] == [] and result["weights_equal"]
    assert set(result["missing"]) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"}
    assert result["model_type"] == "mtp" and result["num_nextn_predict_layers"] == 1 and result["steps"] == 3
    assert result["embed_equal_verifier"]
    assert len(result["logits"]) == len(outputs) == 3
    for k, out in enumerate(outputs):
        torch.testing.assert_close(result["logits"][k], out[0] @ target.lm_head.weight.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(result["loss"], ours.loss, rtol=1e-4, atol=1e-4)
    for k, step_loss in enumerate(result["step_losses"]):  # speculators' per-step terms: w_k * mean CE
        total, count = ours.metrics[f"mtp_step_{k}/loss"]
        torch.testing.assert_close(step_loss, step_weights(0.6, 3)[k] * total / count, rtol=1e-4, atol=1e-4)
    assert set(result["converted"]) == set(initial)
    for name, value in result["converted"].items():
        assert torch.equal(value, initial[name]), name


def test_step_weights_are_beta_powers_normalised():
    assert step_weights(0.6, 3) == pytest.approx([1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])
    assert step_weights(0.5, 1) == [1.0]


# -- the recursion's semantics ------------------------------------------------------------------


def test_step_k_at_row_t_reads_tokens_up_to_t_plus_k_plus_1_and_predicts_t_plus_k_plus_2(mtp_target_dir, target):
    draft = perturbed(new_draft(mtp_target_dir))
    ids, _ = batch(seed=5)
    embeds = target.model.embed_tokens(ids)
    features = capture(target.model, ids, torch.arange(T)[None], draft.capture_request())
    with torch.no_grad():
        base = draft.unroll(features.final_hidden, embeds, features.cos, features.sin)
    V = T - 3 - 1
    assert [out.shape[1] for out in base] == [V] * 3  # the same rows at every step (speculators' valid_len)
    t = 10
    for k in range(3):
        for j, should_change in ((t + k + 1, True), (t + k + 2, False)):
            changed = embeds.clone()
            changed[0, j] += 1.0  # the draft's token input only: the target's hidden states are kept
            with torch.no_grad():
                out = draft.unroll(features.final_hidden, changed, features.cos, features.sin)[k]
            assert (not torch.equal(out[0, t], base[k][0, t])) is should_change, (k, j)
            assert torch.equal(out[0, :t], base[k][0, :t])  # rows before t read tokens before t + k + 1
    # which token step k is taught: with one learned token at p, step k counts row p - k - 2 only,
    # and its CE is that row's logits against x_p
    p = 25
    mask = torch.zeros_like(ids)
    mask[0, p] = 1
    with torch.no_grad():
        loss = draft.training_loss(LossBatch(features, target.lm_head.weight, ids, mask, 0))
    for k in range(3):
        total, count = loss.metrics[f"mtp_step_{k}/loss"]
        assert int(count) == 1
        logits = base[k][0, p - k - 2] @ target.lm_head.weight.t()
        torch.testing.assert_close(total, torch.nn.functional.cross_entropy(logits[None], ids[0, p : p + 1]))


def test_packed_documents_count_no_row_whose_token_is_in_the_next_document(mtp_target_dir, target):
    draft = new_draft(mtp_target_dir)
    ids, _ = batch(seed=6)
    documents = torch.zeros_like(ids)
    documents[0, 20:] = 1
    mask = torch.ones_like(ids)
    positions = torch.cat([torch.arange(20), torch.arange(T - 20)])[None]
    features = capture(target.model, ids, positions, draft.capture_request())
    with torch.no_grad():
        loss = draft.training_loss(LossBatch(features, target.lm_head.weight, ids, mask, 0, documents=documents))
    V = T - 4
    for k in range(3):  # rows t < V whose x_{t+k+2} is in t's document: all but the k+2 before the border
        expected = sum(1 for t in range(V) if (t < 20) == (t + k + 2 < 20))
        assert int(loss.metrics[f"mtp_step_{k}/loss"][1]) == expected
    # the second conversation attends to itself only: its rows are those of the conversation alone
    args = (features.final_hidden, features.input_embeds, features.cos, features.sin)
    with torch.no_grad():
        packed = draft.unroll(*args, documents=documents)
        alone = draft.unroll(*(a[:, 20:] for a in args))
    for k in range(3):
        torch.testing.assert_close(packed[k][0, 20:], alone[k][0, : V - 20], rtol=1e-5, atol=1e-5)


# -- training -----------------------------------------------------------------------------------


def test_training_lowers_the_recursive_loss(mtp_target_dir, data_dir, tmp_path):
    result = train_run(mtp_target_dir, data_dir, tmp_path, "run", max_steps=8, **{"draft.type": "mtp"})
    assert len(result.losses) == 8
    assert sum(result.losses[-2:]) < sum(result.losses[:2]), result.losses


@pytest.mark.parametrize("kind", ["llama", "no_mtp_tensors"])
def test_a_target_without_an_mtp_layer_is_refused_in_one_line(kind, tiny_target_dir, data_dir, tmp_path, capsys):
    target_dir = (
        tiny_target_dir if kind == "llama" else qwen3_next_mtp_target(tmp_path / "plain", tiny_target_dir, mtp=False)
    )
    config = tmp_path / "run.yaml"
    config.write_text(
        "\n".join(
            o.replace("=", ": ", 1)
            for o in run_overrides(target_dir, data_dir, tmp_path / "out", tmp_path / "cache", max_steps=2)
        )
        + "\n"
    )
    capsys.readouterr()
    assert main(["train", str(config), "draft.type=mtp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(target_dir) in err and "native MTP layer" in err, err
    assert not (tmp_path / "out").exists()


# -- exports ------------------------------------------------------------------------------------


def test_the_stitched_target_is_the_target_with_the_trained_layer(mtp_target_dir, tmp_path):
    draft = perturbed(new_draft(mtp_target_dir))
    state = draft.state_dict()
    out = tmp_path / "stitched"
    write_stitched(draft, state, out, str(mtp_target_dir))
    source = load_file(str(mtp_target_dir / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(source)
    half = state["mtp_layers.0.mlp.experts.gate_up_proj"].shape[1] // 2
    renamed = {
        "mtp.fc.weight": "input_proj.weight",
        "mtp.norm.weight": "final_layernorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "hidden_layernorm.weight",
        "mtp.pre_fc_norm_embedding.weight": "token_layernorm.weight",
    }
    for key, value in written.items():
        assert value.dtype == source[key].dtype, key
        if not key.startswith("mtp."):
            assert torch.equal(value, source[key]), key  # the target's own tensors, untouched
            continue
        if ".experts." in key:
            index, proj = key.split(".experts.")[1].split(".")[:2]
            gate_up, down = (state[f"mtp_layers.0.mlp.experts.{n}"] for n in ("gate_up_proj", "down_proj"))
            want = {
                "gate_proj": gate_up[int(index), :half],
                "up_proj": gate_up[int(index), half:],
                "down_proj": down[int(index)],
            }[proj]
        else:
            want = state["mtp_layers.0." + (renamed.get(key) or key[len("mtp.layers.0.") :])]
        assert torch.equal(value, want) and not torch.equal(value, source[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["model_type"] == "qwen3_next"
    for path in mtp_target_dir.iterdir():  # tokenizer and the rest: the target's bytes
        if path.name not in ("model.safetensors", "config.json"):
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    # what a stitched target starts a new run from: the trained layer
    assert all(torch.equal(v, state[k]) for k, v in new_draft(out).state_dict().items())


def test_vllm_serves_it_as_method_mtp():
    """vllm/config/speculative.py: "mtp" is one of MTPModelTypes (a SpeculativeMethod), and
    hf_config_override turns model_type qwen3_next into qwen3_next_mtp (Qwen3NextMTP, n_predict =
    num_nextn_predict_layers); docs/families/mtp.md gives the serve line."""
    assert VLLM_METHOD == "mtp"
    docs = (REPO / "docs" / "families" / "mtp.md").read_text()
    assert '--speculative-config \'{"method": "mtp", "num_speculative_tokens": 3}\'' in docs


# -- decoding -----------------------------------------------------------------------------------


def test_decoding_with_the_draft_is_lossless_and_accepts_its_tokens(mtp_target_dir, target):
    draft = perturbed(new_draft(mtp_target_dir), scale=0.01)
    prompt = batch(seed=9, length=12)[0][0].tolist()
    plain = generate_plain(target, prompt, max_new_tokens=24)
    for kwargs in ({"gamma": 3}, {"tree": [3, 2, 2]}):
        out = speculative_generate(target, draft.make_drafter(target), prompt, max_new_tokens=24, **kwargs)
        assert out.tokens == plain.tokens, kwargs
    sampled = speculative_generate(
        target,
        draft.make_drafter(target),
        prompt,
        max_new_tokens=16,
        gamma=3,
        temperature=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(sampled.tokens) == 16


def test_the_drafter_proposes_what_training_step_zero_predicts(mtp_target_dir, target):
    """With x_0..x_{n-1} verified and x_n the round's root, the first drafted token is drawn from
    training's step-0 distribution at row n - 1 (which reads h_{n-1} and x_n). The second is drawn
    from the layer's own output at n - 1 with the first drafted token, at position n, attending to
    the verified entries (step 0's), as vLLM's proposer runs it (training's step k attends to step
    k's): pinned against a causal pass over those entries plus that row."""
    from specdraft.decode.cache import forward_with_hidden, new_cache

    draft = perturbed(new_draft(mtp_target_dir))
    ids = batch(seed=11, length=20)[0]
    drafter = draft.make_drafter(target)
    cache = new_cache(target)
    n = 15  # tokens 0..14 verified (in the cache), x_15 the round's root
    _, hidden = forward_with_hidden(target, cache, ids[0, :n], torch.arange(n), layers=drafter.target_layers)
    drafter.start()
    drafter.observe_target(hidden, 0)
    tree = drafter.propose_chain(ids[0], cache, 2, 1.0, torch.Generator().manual_seed(0))
    features = capture(target.model, ids, torch.arange(20)[None], draft.capture_request())
    head = target.lm_head.weight.t()
    with torch.no_grad():
        step0 = draft.unroll(features.final_hidden, features.input_embeds, features.cos, features.sin)[0]
        torch.testing.assert_close(tree.q[0], torch.softmax(step0[0, n - 1] @ head, -1), rtol=1e-4, atol=1e-6)
        first = int(tree.tokens[0])
        hidden = torch.cat([features.final_hidden[:, :n], step0[:, n - 1 : n]], dim=1)
        embeds = target.model.embed_tokens(torch.cat([ids[:, 1 : n + 1], torch.tensor([[first]])], dim=1))
        out = draft.step(hidden, embeds, features.cos[:, : n + 1], features.sin[:, : n + 1])
        torch.testing.assert_close(tree.q[1], torch.softmax(out[0, n] @ head, -1), rtol=1e-4, atol=1e-6)


def test_eval_decodes_losslessly_with_a_trained_draft(mtp_target_dir, data_dir, tiny_data, tmp_path, capsys):
    result = train_run(mtp_target_dir, data_dir, tmp_path, "run", max_steps=2, **{"draft.type": "mtp"})
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                str(result.export_dir),
                "--prompts",
                str(tiny_data.prompts_file),
                "--max-prompts",
                "2",
                "--max-new-tokens",
                "12",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["matches_target"] is True


def test_a_hybrid_target_trains_and_eval_refuses_it_in_one_line(tiny_target_dir, tmp_path):
    """Qwen3-Next's linear-attention layers run on CPU (transformers' PyTorch fallbacks of
    causal_conv1d and the gated delta rule): the draft trains on them. Decoding cannot roll their
    recurrent state back after a rejection: refused, one line."""
    hybrid = qwen3_next_mtp_target(tmp_path / "hybrid", tiny_target_dir, hybrid=True)
    target = load_frozen_target(str(hybrid))
    assert "linear_attention" in target.config.layer_types
    draft = new_draft(hybrid)
    ids, mask = batch()
    features = capture(target.model, ids, torch.arange(T)[None], draft.capture_request())
    loss = draft.training_loss(LossBatch(features, target.lm_head.weight, ids, mask, 0))
    loss.loss.backward()
    assert draft.mtp_layers[0].input_proj.weight.grad.abs().sum() > 0
    with pytest.raises(SpecdraftError, match="linear-attention") as err:
        speculative_generate(target, draft.make_drafter(target), ids[0, :8].tolist(), max_new_tokens=8, gamma=2)
    assert "\n" not in str(err.value)


def test_a_hybrid_target_with_packed_conversations_is_refused_naming_document_mask(tiny_target_dir, data_dir, tmp_path):
    """Its linear-attention layers would carry one conversation's state into the next packed one."""
    from helpers import run_overrides
    from specdraft.config import load_config

    hybrid = qwen3_next_mtp_target(tmp_path / "hybrid", tiny_target_dir, hybrid=True)
    base = run_overrides(hybrid, data_dir, tmp_path / "out", tmp_path / "cache", **{"draft.type": "mtp"})
    with pytest.raises(SpecdraftError, match="key 'document_mask': the target's linear-attention layers") as err:
        load_config(None, base)
    assert "\n" not in str(err.value)
    assert load_config(None, [*base, "document_mask=false"]).document_mask is False  # one stream: trains


# -- draft.init_from ------------------------------------------------------------------------------

SPECULATORS_SAVE = r"""
import json, sys, torch
from safetensors import safe_open
from speculators.convert.mtp.converter import MTPConverter
from speculators.models.mtp import MTPDraftModel

target, converted, out = sys.argv[1:4]
MTPConverter().convert(target, converted, base_model=target, num_speculative_steps=3)  # speculators' own tool
model = MTPDraftModel.from_pretrained(converted)
generator = torch.Generator().manual_seed(7)
with torch.no_grad():  # fine-tuned weights of its own; the verifier's tensors stay the verifier's
    for name, p in model.mtp_layers.named_parameters():
        p.add_(torch.randn(p.shape, generator=generator) * 0.05)
model.save_pretrained(out)
with safe_open(out + "/model.safetensors", "pt") as f:
    print(json.dumps({"saved": sorted(f.keys())}))
"""


def test_init_from_our_exports_and_speculators_saves(mtp_target_dir, tmp_path):
    from speculators_env import run_in_speculators
    from specdraft.config import TrainConfig
    from specdraft.export.files import write_draft_export
    from specdraft.export.init_from import read_init_from

    def imported(source):
        cfg = OmegaConf.structured(TrainConfig(target=str(mtp_target_dir), data_files="unused"))
        cfg.draft = OmegaConf.merge(cfg.draft, dict(type="mtp", init_from=str(source)))
        result = read_init_from(cfg, load_target_config(str(mtp_target_dir)))
        draft = new_draft(mtp_target_dir)
        draft.load_state_dict(result.state, strict=True)
        return result.fmt, draft.state_dict()

    ours = perturbed(new_draft(mtp_target_dir))
    cfg = OmegaConf.structured(TrainConfig(target=str(mtp_target_dir), data_files="unused"))
    cfg.draft = OmegaConf.merge(cfg.draft, dict(type="mtp"))
    export = write_draft_export(tmp_path / "step_1", ours.state_dict(), ours, cfg)
    for source, fmt in ((export, "native"), (export / "speculators", "speculators")):
        got_fmt, state = imported(source)
        assert got_fmt == fmt and all(torch.equal(v, ours.state_dict()[k]) for k, v in state.items())
    report = run_in_speculators(SPECULATORS_SAVE, mtp_target_dir, tmp_path / "converted", tmp_path / "theirs")
    fmt, state = imported(tmp_path / "theirs")
    saved = load_file(str(tmp_path / "theirs" / "model.safetensors"))
    target_layer = new_draft(mtp_target_dir).state_dict()
    assert fmt == "speculators" and set(state) == set(saved) == set(report["saved"])
    for name, value in state.items():  # speculators' fine-tuned weights, not the target's layer
        assert torch.equal(value, saved[name]) and not torch.equal(value, target_layer[name]), name
