"""Every draft family x every command that reads a run: `export` in each format the family has,
`consolidate`, `eval` (with the target moved), resume at the same size (bit-identical) and elastic
resume (2 ranks -> 1 rank through DeepSpeed's universal format).

The matrix's last row is one run training every family's draft at once (`drafts:`, each named
by its family): each of its drafts must be the family's own run, bit for bit, at 2 ranks ZeRO-2,
and every command takes it with --draft NAME.

The families come from the registry, so a new family is in this matrix without a line here. Each
family trains once, for 4 steps at 2 ranks ZeRO-2 (saving at 2 and 4), in one torchrun that also
resumes it from step 2 at 2 ranks; everything else runs in this process on 1 rank.

The checkpointed draft is compared with what DeepSpeed itself reads out of the slot
(zero_to_fp32 for the trained parameters) and with the draft the run exported while training, and
the untrained state (EAGLE-3's d2t/t2d, DFlash's frozen mask_delta) with the values the run had.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, torchrun, write_chat_files
from offline_runs import SAVE_STEPS, SEVERAL, SEVERAL_FAMILIES, STEPS, run_config, target_of
from specdraft.cli import main
from specdraft.drafts.registry import FAMILIES
from specdraft.export.files import load_exported_draft
from specdraft.rundir.layout import universal_dir
from specdraft.commands.export import EXPORT_FORMATS
from specdraft.train.loop import train

ELASTIC_TOLERANCE = 1e-5  # see tests/test_distributed.py; measured here: 0 for every family
CASES = [(family, fmt) for family, cls in FAMILIES.items() for fmt in (*EXPORT_FORMATS, *cls.serving_formats)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    path = tmp_path_factory.mktemp("offline")
    write_chat_files(path / "data")
    return path


@pytest.fixture(scope="module")
def runs(served_target_dir, mtp_target_dir, work):
    """{family: {"full": 4 losses, "resumed": the 2 after resuming step 2}}, both at 2 ranks."""
    out = work / "results.json"
    proc = torchrun(
        REPO / "tests" / "offline_script.py", served_target_dir, mtp_target_dir, work / "data", work, out, timeout=700
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def shrunk(served_target_dir, mtp_target_dir, work, runs):
    """Each family's 2-rank step 2 resumed on 1 rank: {family: (losses, log lines)}."""
    results = {}
    for family in FAMILIES:
        lines = []
        cfg = run_config(
            target_of(family, served_target_dir, mtp_target_dir),
            work / "data",
            work,
            family,
            f"{family}_shrunk",
            f"resume={work}/{family}/ckpt/step_{SAVE_STEPS}",
        )
        results[family] = (train(cfg, log=lines.append).losses, lines)
    return results


def last_slot(work, family):
    return work / family / "ckpt" / f"step_{STEPS}"


def deepspeed_fp32(slot):
    """The trained parameters as DeepSpeed itself reads them out of a slot (prefix stripped)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = get_fp32_state_dict_from_zero_checkpoint(str(slot.parent), tag=slot.name, exclude_frozen_parameters=True)
    return {k[len("draft_model.") :]: v for k, v in full.items() if k.startswith("draft_model.")}


def assert_same(got, want, keys=None):
    keys = set(want) if keys is None else keys
    assert keys <= set(got), sorted(keys - set(got))
    for key in keys:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def exported(export_dir):
    draft, _ = load_exported_draft(export_dir)
    return draft


# -- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_resume_at_the_same_size_is_bit_identical(runs, family):
    full, resumed = runs[family]["full"], runs[family]["resumed"]
    assert len(full) == STEPS and resumed == full[SAVE_STEPS:]  # exact float equality, fp32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_elastic_resume_on_one_rank_continues_the_two_rank_run(runs, shrunk, work, family):
    losses, lines = shrunk[family]
    assert any(line.startswith("resume: converted") for line in lines), lines
    # the copy is the resuming run's (pruned at its first save), never written into the source run
    copy = universal_dir(work / f"{family}_shrunk" / "ckpt" / f"step_{SAVE_STEPS}")
    assert any(line.startswith("resume: converted") and line.endswith(str(copy)) for line in lines), lines
    assert not universal_dir(work / family / "ckpt" / f"step_{SAVE_STEPS}").exists()
    straight = runs[family]["full"][SAVE_STEPS:]
    assert len(losses) == len(straight)
    assert max(abs(a - b) for a, b in zip(losses, straight)) <= ELASTIC_TOLERANCE, (losses, straight)
    # the draft it ends with: the straight run's, its untrained state exactly
    resumed, straight_draft = (exported(work / name / f"step_{STEPS}") for name in (f"{family}_shrunk", family))
    for name, value in straight_draft.state_dict().items():
        got = resumed.state_dict()[name]
        if name in dict(straight_draft.named_parameters()) and straight_draft.get_parameter(name).requires_grad:
            torch.testing.assert_close(got, value, rtol=0, atol=1e-5)
        else:
            assert got.dtype == value.dtype and torch.equal(got, value), name


# -- export, consolidate ---------------------------------------------------------------------------


@pytest.mark.parametrize("family,fmt", CASES)
def test_export_from_the_checkpoint_is_the_trained_draft(runs, work, family, fmt):
    run_dir = work / family
    out = work / f"{family}_export_{fmt}"
    assert main(["export", str(run_dir), "--format", fmt, "--out", str(out)]) == 0
    live = run_dir / f"step_{STEPS}"  # written by the run itself, from the engine's gathered draft
    if fmt in FAMILIES[family].serving_formats:
        assert (out / fmt / "config.json").is_file()
        if (live / fmt).is_dir():  # the family's defaults wrote it during training too
            assert json.loads((out / fmt / "config.json").read_text()) == json.loads(
                (live / fmt / "config.json").read_text()
            )
            assert_same(
                load_file(str(out / fmt / "model.safetensors")), load_file(str(live / fmt / "model.safetensors"))
            )
        return
    weights = (
        load_file(str(out / "model.safetensors"))
        if fmt != "pth"
        else torch.load(out / "draft_model_weights.pth", weights_only=True)
    )
    live_weights = load_file(str(live / "model.safetensors"))
    assert_same(weights, live_weights)  # every key: trained, buffers and frozen, in their dtypes
    slot_weights = deepspeed_fp32(last_slot(work, family))
    for key, value in slot_weights.items():  # what DeepSpeed reads out of the slot
        if value.is_floating_point() and key in weights and weights[key].is_floating_point():
            assert torch.equal(weights[key].float(), value), key
    if fmt == "native":
        assert (out / "config.json").is_file() and (out / "draft_model_weights.pth").is_file()
        assert set(exported(out).state_dict()) == set(live_weights)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_consolidate_writes_the_whole_trained_draft(runs, work, family):
    run_dir = work / family
    assert main(["consolidate", str(run_dir)]) == 0
    consolidated = load_file(str(run_dir / "consolidated" / f"step_{STEPS}" / "draft_fp32.safetensors"))
    live = load_file(str(run_dir / f"step_{STEPS}" / "model.safetensors"))
    assert_same(consolidated, live)
    assert set(consolidated) == set(live)


# -- eval ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_eval_with_the_target_moved_needs_and_takes_target(
    runs, served_target_dir, mtp_target_dir, tiny_data, work, family, capsys
):
    served_target_dir = target_of(family, served_target_dir, mtp_target_dir)
    moved = work / f"{family}_elsewhere"
    shutil.copytree(work / family / f"step_{STEPS}", moved)
    config = json.loads((moved / "config.json").read_text())
    config["target"]["path"] = str(work / "no_such_machine" / "target")  # trained on another machine
    (moved / "config.json").write_text(json.dumps(config))
    args = [
        "eval",
        str(moved),
        "--prompts",
        str(tiny_data.prompts_file),
        "--max-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--json",
    ]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no_such_machine" in err and "--target" in err, err
    assert main([*args, "--target", str(served_target_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matches_target"] is True and report["target"] == str(served_target_dir)
    assert main([*args, "--target", str(work / "nowhere")]) == 2
    assert "--target" in capsys.readouterr().err


# -- the row of several drafts: one run training every family's draft (named by its family) -------


def several_slot_files(run_dir, name):
    return run_dir / "ckpt" / f"step_{STEPS}" / name


@pytest.fixture(scope="module")
def several_shrunk(served_target_dir, work, runs):
    """The several-draft run's 2-rank step 2 resumed on 1 rank: (losses by draft, log lines)."""
    lines = []
    cfg = run_config(
        served_target_dir,
        work / "data",
        work,
        SEVERAL,
        f"{SEVERAL}_shrunk",
        f"resume={work}/{SEVERAL}/ckpt/step_{SAVE_STEPS}",
    )
    return train(cfg, log=lines.append).draft_losses, lines


@pytest.mark.parametrize("family", list(SEVERAL_FAMILIES))
def test_each_draft_of_a_several_draft_run_trains_as_its_family_alone_at_two_ranks(runs, work, family):
    assert runs[SEVERAL]["full"][family] == runs[family]["full"]  # every step, exact (fp32, ZeRO-2)
    together = load_file(str(work / SEVERAL / f"step_{STEPS}" / family / "model.safetensors"))
    assert_same(together, load_file(str(work / family / f"step_{STEPS}" / "model.safetensors")))


def test_a_several_draft_run_resumes_bit_identically_and_elastically_on_one_rank(runs, several_shrunk, work):
    full, resumed = runs[SEVERAL]["full"], runs[SEVERAL]["resumed"]
    assert set(resumed) == set(SEVERAL_FAMILIES) and all(
        resumed[name] == full[name][SAVE_STEPS:] for name in SEVERAL_FAMILIES
    )
    losses, lines = several_shrunk
    assert sum(line.startswith("resume: converted") for line in lines) == len(SEVERAL_FAMILIES), lines
    for name in SEVERAL_FAMILIES:
        copy = universal_dir(work / f"{SEVERAL}_shrunk" / "ckpt" / f"step_{SAVE_STEPS}") / name
        assert any(line.startswith("resume: converted") and line.endswith(str(copy)) for line in lines), lines
        assert not universal_dir(work / SEVERAL / "ckpt" / f"step_{SAVE_STEPS}").exists()
        straight = full[name][SAVE_STEPS:]
        assert len(losses[name]) == len(straight)
        assert max(abs(a - b) for a, b in zip(losses[name], straight)) <= ELASTIC_TOLERANCE, (name, losses, straight)
    # one commit for every draft: the slot's one COMMITTED lists each draft's files
    record = json.loads((work / SEVERAL / "ckpt" / f"step_{STEPS}" / "COMMITTED").read_text())
    assert sorted(record["drafts"]) == sorted(SEVERAL_FAMILIES)
    assert {name.split("/")[0] for name in record["files"] if "/" in name} == set(SEVERAL_FAMILIES)


@pytest.mark.parametrize("family,fmt", [case for case in CASES if case[0] in SEVERAL_FAMILIES])
def test_export_of_each_draft_of_a_several_draft_run(runs, work, family, fmt):
    run_dir = work / SEVERAL
    out = work / f"{SEVERAL}_{family}_export_{fmt}"
    assert main(["export", str(run_dir), "--draft", family, "--format", fmt, "--out", str(out)]) == 0
    alone = work / f"{family}_alone_export_{fmt}"  # the same format of the family's own run
    assert main(["export", str(work / family), "--format", fmt, "--out", str(alone)]) == 0
    if fmt in FAMILIES[family].serving_formats:  # the files that engine loads, byte for byte
        files = sorted(p.name for p in (alone / fmt).iterdir() if p.name != "training_config.yaml")
        assert files and sorted(p.name for p in (out / fmt).iterdir() if p.name != "training_config.yaml") == files
        for name in files:
            assert (out / fmt / name).read_bytes() == (alone / fmt / name).read_bytes(), name
        return
    if fmt == "pth":
        weights, want = (torch.load(d / "draft_model_weights.pth", weights_only=True) for d in (out, alone))
    else:
        weights, want = (load_file(str(d / "model.safetensors")) for d in (out, alone))
    assert set(weights) == set(want)
    assert_same(weights, want)
    if fmt == "native":  # the export names the draft's own config, as the family's run does
        hashes = [json.loads((d / "config.json").read_text())["target"]["config_hash"] for d in (out, alone)]
        assert hashes[0] == hashes[1]


@pytest.mark.parametrize("family", list(SEVERAL_FAMILIES))
def test_consolidate_each_draft_of_a_several_draft_run(runs, work, family):
    run_dir = work / SEVERAL
    assert main(["consolidate", str(run_dir), "--draft", family]) == 0
    consolidated = load_file(str(run_dir / "consolidated" / f"step_{STEPS}" / family / "draft_fp32.safetensors"))
    live = load_file(str(run_dir / f"step_{STEPS}" / family / "model.safetensors"))
    assert set(consolidated) == set(live)
    assert_same(consolidated, live)


def test_a_several_draft_run_needs_draft_name_where_one_draft_is_meant(runs, work, capsys):
    run_dir = work / SEVERAL
    names = ", ".join(SEVERAL_FAMILIES)
    for args in (["export", str(run_dir)], ["consolidate", str(run_dir)], ["export", str(run_dir), "--draft", "nope"]):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and names in err, err
    capsys.readouterr()
    assert main(["export", str(work / "glide"), "--draft", "glide"]) == 2  # a one-draft run takes none
    assert "--draft glide: this run trains one draft" in capsys.readouterr().err


def test_eval_of_a_several_draft_run_puts_every_draft_side_by_side(runs, tiny_data, work, capsys):
    args = [
        "eval",
        str(work / SEVERAL),
        "--prompts",
        str(tiny_data.prompts_file),
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "6",
        "--device",
        "cpu",
    ]
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert sorted(reports) == sorted(SEVERAL_FAMILIES)
    for name, report in reports.items():
        assert report["draft"] == str(work / SEVERAL / f"step_{STEPS}" / name) and report["matches_target"] is True
    assert main(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith(f"specdraft eval: {len(SEVERAL_FAMILIES)} drafts")
    assert [line.split()[0] for line in table[4:]] == sorted(SEVERAL_FAMILIES)
    assert main([*args, "--draft", "eagle3", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["draft"] == str(work / SEVERAL / f"step_{STEPS}" / "eagle3") and one["tau"] == reports["eagle3"]["tau"]
    args[1] = str(work / SEVERAL / f"step_{STEPS}")  # the step's export directory of every draft
    assert main([*args, "--draft", "glide", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tau"] == reports["glide"]["tau"]
