"""`draft.init_from` in real runs (DeepSpeed, 1 CPU rank, all in this process):

- fine-tuning from an imported EAGLE-3 draft (the official release layout, a pytorch_model.bin)
  trains, its first loss is the imported draft's loss on that batch computed apart from the run,
  not a random draft's; its d2t/t2d are the imported ones, and the data's disagreement is reported;
- a resumed run does not import again;
- `specdraft eval` gives the same tau before and after a round trip through another format;
- bad files stop `specdraft train` with one line and exit 2, before anything is written.
"""

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import run_overrides
from specdraft.cli import main
from specdraft.config import load_config
from specdraft.data.sampler import ShardedBatchSampler
from specdraft.target.model import load_frozen_target
from specdraft.export.files import load_exported_draft, write_draft_export
from specdraft.export.init_from import read_init_from
from specdraft.train.data import prepare_data
from specdraft.train.loop import batch_generator, device_inputs, host_batch, model_inputs, train
from specdraft.train.model import TargetWithDraft
from test_imports import RunsCode, export_in, rewrite, weights_file

EAGLE3 = {"draft.type": "eagle3", "draft.ttt_steps": 2, "draft.draft_vocab_size": 200}
STEPS = 3


def config(target, data, root, name, **extra):
    values = {**EAGLE3, "max_steps": STEPS, "save_steps": STEPS, **extra}
    return load_config(None, run_overrides(target, data, root / name, root / "cache", **values))


@pytest.fixture(scope="module")
def runs(served_target_dir, data_dir, tiny_data, tmp_path_factory):
    """A: an EAGLE-3 trained on the chat data; its release layout (.bin); B: fine-tuned from it on
    the tiny demo data; C: the same as B from random weights."""
    root = tmp_path_factory.mktemp("imports_train")
    a = train(config(served_target_dir, data_dir, root, "a"), log=lambda *_: None)
    assert main(["export", str(root / "a"), "--format", "sglang", "--out", str(root / "release")]) == 0
    release = root / "release" / "sglang"
    torch.save(load_file(str(release / "model.safetensors")), release / "pytorch_model.bin")
    (release / "model.safetensors").unlink()
    lines = []
    b_cfg = config(
        served_target_dir,
        tiny_data.train_files[0].parent,
        root,
        "b",
        **{"draft.init_from": str(release / "pytorch_model.bin")},
    )
    b = train(b_cfg, log=lines.append)
    c = train(config(served_target_dir, tiny_data.train_files[0].parent, root, "c"), log=lambda *_: None)
    return dict(root=root, a=a, b=b, c=c, b_cfg=b_cfg, lines=lines, release=release)


def first_batch_loss(cfg, draft) -> float:
    """The loss of `draft` on the run's first micro-batch with its options, outside any engine."""
    from transformers import AutoTokenizer

    data = prepare_data(cfg, AutoTokenizer.from_pretrained(cfg.target), 0, lambda *_: None)
    sampler = ShardedBatchSampler(len(data), cfg.per_device_batch_size, 0, 1, cfg.seed, cfg.gradient_accumulation_steps)
    batch = model_inputs(data.batch(sampler.next_batch()), cfg.document_mask)
    options = draft.sample_batch_options(batch_generator(cfg.seed, 0, 0), cfg.max_seq_length)
    model = TargetWithDraft(load_frozen_target(cfg.target, cfg.precision), draft.train(), cfg.loss_chunk_size)
    out = model(**device_inputs(batch, "cpu"), host=host_batch(batch), **options)
    return float(out.loss.detach().double() * out.tokens.double() / out.tokens.double())  # as the loop's window reduces


def test_fine_tuning_an_imported_eagle3_starts_at_its_loss_and_trains(runs):
    imported, _ = load_exported_draft(runs["root"] / "a" / f"step_{STEPS}")
    b, c = runs["b"], runs["c"]
    assert b.losses[0] == first_batch_loss(runs["b_cfg"], imported)  # exactly: the imported draft's loss
    assert b.losses[0] < c.losses[0]  # not a random draft's: A learnt the target on the chat data
    assert b.losses[-1] < b.losses[0]  # and it trains
    assert any(
        line.startswith(f"draft.init_from: sglang draft {runs['release'] / 'pytorch_model.bin'}")
        for line in runs["lines"]
    ), runs["lines"]


def test_the_imported_vocabulary_is_kept_and_the_datas_disagreement_reported(runs):
    source = load_file(str(runs["root"] / "a" / f"step_{STEPS}" / "model.safetensors"))
    tuned = load_file(str(runs["root"] / "b" / f"step_{STEPS}" / "model.safetensors"))
    assert torch.equal(tuned["d2t"], source["d2t"]) and torch.equal(tuned["t2d"], source["t2d"])  # never recounted
    # the tiny data's own 200 most frequent answer tokens, counted here from B's packed data
    line = next(line for line in runs["lines"] if "most frequent answer tokens" in line)
    outside, top = map(
        int,
        re.match(
            r"draft.init_from: (\d+) of the data's (\d+) most frequent answer tokens are "
            r"outside the imported draft vocabulary of 200 ",
            line,
        ).groups(),
    )
    assert (outside, top) == data_top_outside(runs["b_cfg"], source["t2d"])
    assert outside > 0  # the tiny demo data is not the chat data A's vocabulary was counted on


def data_top_outside(cfg, t2d) -> int:
    from transformers import AutoTokenizer

    data = prepare_data(cfg, AutoTokenizer.from_pretrained(cfg.target), 0, lambda *_: None)
    # every window's loss-masked tokens, as the draft vocabulary counts them (whole or stream packing)
    tokens = np.concatenate(
        [
            np.asarray(data.tokens[i : i + 1])[np.asarray(data.loss_mask[i : i + 1]).astype(bool)]
            for i in range(len(data))
        ]
    )
    counts = np.bincount(tokens, minlength=t2d.numel())
    top = [
        i for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:200] if counts[i] > 0
    ]  # ties: lower id
    return sum(1 for i in top if not bool(t2d[i])), len(top)


def test_a_resumed_run_does_not_import_again(runs, served_target_dir, tiny_data):
    lines = []
    cfg = config(
        served_target_dir,
        tiny_data.train_files[0].parent,
        runs["root"],
        "b",
        max_steps=STEPS + 1,
        **{"draft.init_from": str(runs["release"] / "pytorch_model.bin")},
    )
    result = train(cfg, log=lines.append)
    assert f"resumed from {runs['root'] / 'b' / 'ckpt' / f'step_{STEPS}'} at step {STEPS}" in lines
    assert any("is not imported again" in line for line in lines) and not any(
        line.startswith("draft.init_from: sglang draft") for line in lines
    )
    assert len(result.losses) == 1


def test_eval_gives_the_same_tau_before_and_after_a_round_trip(runs, served_target_dir, tiny_data, capsys):
    from transformers import AutoConfig

    cfg = runs["b_cfg"].copy()
    cfg.draft.init_from = str(runs["release"] / "pytorch_model.bin")
    imported = read_init_from(cfg, AutoConfig.from_pretrained(served_target_dir))
    before = runs["root"] / "a" / f"step_{STEPS}"
    draft, _ = load_exported_draft(before)
    draft.load_state_dict(imported.state, strict=True)
    after = write_draft_export(runs["root"] / "round_trip" / "step_1", draft.state_dict(), draft, cfg, serving=[])
    reports = []
    for export in (before, after):
        capsys.readouterr()
        assert (
            main(
                [
                    "eval",
                    str(export),
                    "--prompts",
                    str(tiny_data.prompts_file),
                    "--max-prompts",
                    "4",
                    "--max-new-tokens",
                    "16",
                    "--device",
                    "cpu",
                    "--json",
                ]
            )
            == 0
        )
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["tau"] == reports[1]["tau"] and reports[0]["tau"] > 1.0
    assert reports[0]["acceptance_per_position"] == reports[1]["acceptance_per_position"]


# -- bad files: one line, exit 2, nothing written ----------------------------------------------------

KINDS = ("wrong_shape", "missing", "pickle_runs_code")
FORMATS = [
    ("glide", "native", "", "self_attn.o_proj.weight"),
    ("glide", "longspec", "", "mlp.up_proj.weight"),
    ("eagle3", "speculators", "", "layers.0.mlp.down_proj.weight"),
    ("eagle3", "sglang", "pytorch_model.bin", "midlayer.self_attn.q_proj.weight"),
    ("dflash", "speculators", "", "layers.0.self_attn.k_proj.weight"),
    ("dspark", "speculators", "", "confidence_head.proj.weight"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family,fmt,path,tensor", FORMATS, ids=[f"{f[0]}-{f[1]}" for f in FORMATS])
def test_specdraft_train_refuses_a_bad_import_in_one_line_and_writes_nothing(
    served_target_dir, data_dir, tmp_path, capsys, family, fmt, path, tensor, kind
):
    from test_imports import SMALL

    _, _, source = export_in(served_target_dir, tmp_path / "bad", family, fmt, path)
    weights = weights_file(source)
    marker = tmp_path / "it_ran"
    if kind == "wrong_shape":
        rewrite(weights, lambda t: t.__setitem__(tensor, torch.zeros(3, 5)))
    elif kind == "missing":
        rewrite(weights, lambda t: t.pop(tensor))
    else:
        weights.unlink()
        weights = weights.with_name("draft_model_weights.pth" if weights.suffix == ".pth" else "pytorch_model.bin")
        torch.save({tensor: torch.zeros(1), "payload": RunsCode(marker)}, weights)
    options = {f"draft.{k}": str(v).replace(" ", "") for k, v in SMALL[family].items()}
    args = run_overrides(
        served_target_dir,
        data_dir,
        tmp_path / "run",
        tmp_path / "cache",
        max_steps=1,
        **{"draft.type": family, "draft.init_from": str(source), **options},
    )
    capsys.readouterr()
    code = main_train(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    expected = {
        "wrong_shape": f"tensor {tensor!r} has shape (3, 5)",
        "missing": f"missing tensor {tensor!r}",
        "pickle_runs_code": "refused: the pickle asks for more than tensors",
    }[kind]
    assert err.startswith(f"specdraft: error: {weights}: ") and expected in err, err
    assert not marker.exists() and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def main_train(overrides) -> int:
    """`specdraft train` with the config given as overrides only (an empty YAML file)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as empty:
        empty.write("{}\n")
        empty.flush()
        return main(["train", empty.name, *overrides])
