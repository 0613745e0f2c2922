"""The MTP demo (preset "mtp", configs/demo-mtp.yaml): a Qwen3-Next checkpoint whose native MTP
layer pre-trained beside it, stored under the names Qwen's checkpoints use, read back by
draft.type mtp as the very layer that trained; `specdraft demo --config demo-mtp` trains it.
Checked on a smaller copy of the preset (same recipe, seconds to build)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3NextForCausalLM

from specdraft.cli import main
from specdraft.demo.command import preset_of
from specdraft.config import demo_config_path
from specdraft.demo import presets
from specdraft.demo.assets import ensure_demo_assets
from specdraft.demo.mtp_target import MTP_FILE, MTPHead
from specdraft.demo.target import _token_stream
from specdraft.drafts import DraftConfig
from specdraft.drafts.registry import build_draft
from specdraft.target.model import load_target_config
from specdraft.target.checkpoint_files import SAFETENSORS_INDEX

SMALL = dataclasses.replace(
    presets.get_preset("mtp"),
    name="mtp-small",
    corpus_bytes=300_000,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=256,
    train_steps=60,
    batch_size=4,
    seq_len=64,
    warmup_steps=5,
    log_every=10,
    train_rows=48,
    prompt_rows=4,
    train_files=2,
    max_prompt_tokens=96,
    max_new_tokens=16,
    generate_batch=16,
)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setitem(presets.PRESETS, SMALL.name, SMALL)
    root = tmp_path_factory.mktemp("mtp-home")
    ensure_demo_assets(root, preset=SMALL.name, log=lambda m: None, progress_bar=False)
    yield root
    patch.undo()


@pytest.fixture(scope="module")
def target_dir(home):
    return home / SMALL.name / "target"


def test_the_mtp_demo_config_names_the_mtp_preset_and_every_family_has_a_demo():
    assert preset_of(demo_config_path("demo-mtp")) == "mtp"
    assert preset_of(demo_config_path("demo-eagle3")) == "demo"
    assert presets.get_preset("mtp").architecture == "qwen3_next"


def test_the_target_is_a_qwen3_next_checkpoint_holding_its_mtp_layer(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir)  # transformers' loader skips mtp.*
    assert isinstance(model, Qwen3NextForCausalLM)
    config = json.loads((target_dir / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1  # vLLM's n_predict for method "mtp"
    assert set(config["layer_types"]) == {"full_attention"}
    index = json.loads((target_dir / SAFETENSORS_INDEX).read_text())["weight_map"]
    mtp_keys = {k for k, file in index.items() if file == MTP_FILE}
    with safe_open(str(target_dir / MTP_FILE), "pt") as f:
        assert set(f.keys()) == mtp_keys
    # Qwen3-Next's names (vLLM qwen3_next_mtp.py), experts one by one as its checkpoints hold them
    assert {
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.experts.3.down_proj.weight",
        "mtp.layers.0.mlp.shared_expert.gate_proj.weight",
    } <= mtp_keys
    assert all(k.startswith("mtp.") for k in mtp_keys) and not any(k.startswith("mtp.") for k in set(index) - mtp_keys)


def windows(target_dir, count=4, length=64, seed=5):
    """Windows of the token stream the target pre-trained on."""
    from specdraft.demo.corpus import extract_functions, read_corpus

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stream = _token_stream(extract_functions(read_corpus(SMALL.corpus_bytes, 0)), tokenizer, 0)
    starts = torch.randint(0, stream.numel() - length, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def mtp_cross_entropy(draft, model, batch):
    """The draft's x_{t+2} loss at every t, through its own step (what training runs)."""
    with torch.no_grad():
        hidden = model.model(input_ids=batch).last_hidden_state
        positions = torch.arange(batch.shape[1] - 2).expand(batch.shape[0], -1)
        cos, sin = model.model.rotary_emb(hidden, positions)
        out = draft.step(hidden[:, :-2], model.model.embed_tokens(batch[:, 1:-1]), cos, sin)
        return F.cross_entropy(F.linear(out, model.lm_head.weight).flatten(0, 1), batch[:, 2:].flatten()).item()


def test_draft_type_mtp_reads_the_layer_that_pretrained_beside_the_target(target_dir):
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    config = OmegaConf.structured(DraftConfig(type="mtp"))
    draft = build_draft(config, load_target_config(str(target_dir))).eval()  # reads the target's mtp.*
    batch = windows(target_dir)
    trained = mtp_cross_entropy(draft, model, batch)
    # the pre-training's own loss, with the draft's tensors in its head: the same function
    head = MTPHead(model.config, seed=0)
    head.layer.load_state_dict(draft.mtp_layers[0].state_dict())
    with torch.no_grad():
        assert head.loss(model, batch)[1].item() == pytest.approx(trained, rel=1e-5)
    draft.init_weights(model.config.initializer_range)  # the same layer, not pre-trained
    untrained = mtp_cross_entropy(draft, model, batch)
    assert untrained > trained + 1.0, (untrained, trained)


def test_demo_mtp_trains_the_targets_layer_through_the_demo_command(home, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_HOME", str(home))
    monkeypatch.setitem(presets.PRESETS, SMALL.name, SMALL)
    out = tmp_path / "run"
    code = main(
        [
            "demo",
            "--config",
            "demo-mtp",
            "--preset",
            SMALL.name,
            f"output_dir={out}",
            "max_steps=4",
            "save_steps=4",
            "eval_steps=0",
            "logging_steps=1",
            "per_device_batch_size=2",
            "max_seq_length=64",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert any("mtp_step_2/loss" in row for row in rows)  # the demo config's 3 recursive steps


def test_the_acceptance_bench_trains_and_measures_mtp_on_its_target(home, tmp_path, monkeypatch):
    """bench/acceptance.py --families mtp on the mtp preset's assets: lossless greedy, and its
    draft forwards counted on the MTP layer (a draft without `layers` counted none before)."""
    from test_bench import load_bench

    monkeypatch.setitem(presets.PRESETS, SMALL.name, SMALL)
    data = home / SMALL.name / "data"
    results = load_bench("acceptance").main(
        [
            "--target",
            str(home / SMALL.name / "target"),
            "--prompts",
            str(data / "prompts.jsonl"),
            "--data",
            str(data / "answers" / "shard-*.jsonl"),
            "--families",
            "mtp",
            "--train-steps",
            "2",
            "--temperatures",
            "0",
            "--max-prompts",
            "2",
            "--max-new-tokens",
            "8",
            "--gamma",
            "3",
            "--tree",
            "",
            "--out",
            str(tmp_path),
        ]
    )
    rows = {row["label"]: row for row in results["rows"]}
    assert set(rows) == {"MTP", "prompt lookup"}
    assert rows["MTP"]["matches_target"] and rows["prompt lookup"]["matches_target"]
    assert rows["MTP"]["draft_forwards_per_token"] > 0 and rows["prompt lookup"]["draft_forwards_per_token"] == 0
