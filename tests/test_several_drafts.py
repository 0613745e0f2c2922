"""Several drafts from one target pass (`drafts:`), on 1 CPU rank at fp32: the config, each draft
trained bit for bit as it would be alone, one slot commit for every draft (exact resume, fallback
to the older slot, keep_last, SIGKILL during saves), the memory model of the whole set.

The 2-rank ZeRO-2 run of every family at once, its elastic resume and the offline commands on it
are the last row of tests/test_offline_commands.py's matrix.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from helpers import REPO, free_port, launch_env, run_overrides, train_run
from specdraft.config import config_hash, draft_view, load_config, save_config
from specdraft.errors import SpecdraftError
from specdraft.checkpoint.slots import committed_slots, verify_slot

STEPS = 5
# small drafts of four families; each name is the folder the draft's files go to
SECTIONS = {
    "g": {"type": "glide", "max_lag": 2},
    "e3": {"type": "eagle3", "ttt_steps": 2, "draft_vocab_size": 200, "learning_rate": 3e-3},
    "ds": {"type": "dspark", "num_layers": 1, "block_size": 4, "max_anchors": 16, "markov_rank": 8},
    "df": {"type": "dflash", "num_layers": 1, "block_size": 4, "max_anchors": 16, "warmup_steps": 1},
}
PER_DRAFT = ("learning_rate", "warmup_steps")  # what SECTIONS sets for a draft besides its `draft.` keys


def sections(names) -> str:
    """The `drafts:` value of a run of these drafts."""
    return json.dumps({name: SECTIONS[name] for name in names})


def drafts_value(names) -> str:
    return f"drafts={sections(names)}"


def alone_overrides(name) -> dict:
    """The one-draft run of SECTIONS[name]: its keys under draft., its own optimizer keys at the top."""
    return {(key if key in PER_DRAFT else f"draft.{key}"): value for key, value in SECTIONS[name].items()}


def losses_by_step(metrics_file, name):
    return [(row["step"], row[f"{name}/loss"]) for row in map(json.loads, open(metrics_file))]


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            'drafts={a: {type: glide}}", "draft.max_lag=3',
            "key 'drafts': give either draft: (one draft) or drafts: (several), not both (draft.max_lag is set)",
        ),
        ('drafts={"a b": {type: glide}}', "key 'drafts.a b': a draft name must be"),
        ("drafts={ckpt: {type: glide}}", "key 'drafts.ckpt': a draft name must be"),
        ("drafts={step_3: {type: glide}}", "key 'drafts.step_3': a draft name must be"),  # a run's export name
        (
            "drafts={e3: {type: eagle3}, E3: {type: glide}}",
            "key 'drafts.E3': the same folder name as drafts.e3 on a case-insensitive filesystem",
        ),
        ("drafts={g: {type: glide, block_size: 4}}", "key 'drafts.g.block_size': not a key of draft.type 'glide'"),
        (
            "drafts={g: {type: glide, max_lagg: 4}}",
            "unknown key 'drafts.g.max_lagg' (did you mean 'drafts.g.max_lag'?)",
        ),
        ("drafts={g: {type: glide, learning_rate: 0}}", "key 'drafts.g.learning_rate': must be > 0, got 0"),
        ("drafts={g: {type: medusa}}", "key 'drafts.g.type': 'medusa' is not one of"),
        (
            "drafts={g: {type: glide, anchor_offset: true}, e3: {type: eagle3}}",
            "key 'drafts.g': this draft moves the target's positions per batch",
        ),
        ("drafts={}", "key 'drafts': expected a mapping of draft names to draft sections"),
    ],
)
def test_a_bad_drafts_section_is_one_line_naming_the_key(tiny_target_dir, data_dir, tmp_path, override, expected):
    base = run_overrides(tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache")
    with pytest.raises(SpecdraftError) as err:
        load_config(None, [*base, *override.split('", "')])
    assert "\n" not in str(err.value) and expected in str(err.value), str(err.value)


def test_each_draft_is_configured_hashed_and_saved_as_its_run_alone(tiny_target_dir, data_dir, tmp_path):
    base = run_overrides(tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache")
    several = load_config(None, [*base, drafts_value(["g", "e3"])])
    for name in ("g", "e3"):
        alone = load_config(None, [*base, *(f"{k}={v}" for k, v in alone_overrides(name).items())])
        assert config_hash(draft_view(several, name)) == config_hash(alone)
        assert draft_view(several, name).learning_rate == alone.learning_rate
    assert draft_view(several, "e3").learning_rate == 3e-3 and draft_view(several, "g").learning_rate == 1e-2
    # a one-draft run's saved config is as it was: no drafts key
    save_config(load_config(None, base), tmp_path / "one.yaml")
    assert "drafts" not in OmegaConf.load(tmp_path / "one.yaml")
    save_config(several, tmp_path / "several.yaml")
    saved = OmegaConf.load(tmp_path / "several.yaml")
    assert "draft" not in saved and saved.drafts.e3.learning_rate == 3e-3 and saved.drafts.g.max_lag == 2
    assert config_hash(load_config(str(tmp_path / "several.yaml"))) == config_hash(several)


def test_resume_no_of_a_several_drafts_run_means_no_as_in_a_run_of_one(tiny_target_dir, data_dir, tmp_path):
    """YAML reads a bare `no` as False; a run of one draft reads it back as "no", and so must a run
    of several (it once kept False and looked for a checkpoint called 'False')."""
    base = run_overrides(tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache")
    (tmp_path / "several.yaml").write_text("resume: no\n")
    for path, extra in ((None, ["resume=no"]), (str(tmp_path / "several.yaml"), [])):
        several = load_config(path, [*base, drafts_value(["g", "e3"]), *extra])
        assert several.resume == "no" and draft_view(several, "g").resume == "no"


def test_zero3_partitioned_target_is_refused_for_several_drafts(tiny_target_dir, data_dir, tmp_path):
    from specdraft.train.engine import resolve_target_placement

    cfg = load_config(
        None,
        [
            *run_overrides(tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache"),
            drafts_value(["g", "e3"]),
            "zero_stage=3",
            "target_placement=partitioned",
        ],
    )
    with pytest.raises(SpecdraftError, match="partitioned is not available to a run of several drafts"):
        resolve_target_placement(cfg, None, 1)


# -- training: each draft as alone -----------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_target_dir, tmp_path_factory):
    """Three drafts together and two together (saving every step, keeping 3 slots), and each of
    the four drafts alone, on the same data and seed."""
    from helpers import write_chat_files

    root = tmp_path_factory.mktemp("several")
    write_chat_files(root / "data")
    common = dict(max_steps=STEPS, save_steps=1, keep_last=3)
    lines = []
    from specdraft.train.loop import train

    cfg = load_config(
        None,
        run_overrides(
            tiny_target_dir, root / "data", root / "three", root / "cache", drafts=sections(["g", "e3", "ds"]), **common
        ),
    )
    results = {"three": train(cfg, log=lines.append), "lines": lines}
    results["two"] = train_run(tiny_target_dir, root / "data", root, "two", drafts=sections(["e3", "df"]), **common)
    for name in SECTIONS:
        results[name] = train_run(tiny_target_dir, root / "data", root, name, **alone_overrides(name), **common)
    # a one-entry drafts: mapping of a draft that moves the target's positions, and that draft alone
    results["moved"] = train_run(
        tiny_target_dir, root / "data", root, "moved", drafts=json.dumps({"ga": MOVED}), **common
    )
    results["ga"] = train_run(
        tiny_target_dir, root / "data", root, "ga", **{f"draft.{key}": value for key, value in MOVED.items()}, **common
    )
    return root, results


MOVED = {"type": "glide", "max_lag": 2, "anchor_offset": True}  # Anchor-Offset: the target reads shifted positions


def test_a_one_draft_mapping_keeps_the_positions_a_draft_gives_the_target(runs):
    """GLIDE's anchor_offset moves the target's positions per batch: under `drafts:` alone it must
    train bit for bit as `draft:` does (the target pass takes its positions)."""
    _, results = runs
    alone = results["ga"].losses
    assert len(alone) == STEPS and results["moved"].draft_losses["ga"] == alone


@pytest.mark.parametrize("together, names", [("three", ["g", "e3", "ds"]), ("two", ["e3", "df"])])
def test_each_draft_trains_bit_for_bit_as_it_does_alone(runs, together, names):
    root, results = runs
    assert list(results[together].draft_losses) == names and results[together].losses == []
    for name in names:
        alone = results[name].losses
        assert len(alone) == STEPS and results[together].draft_losses[name] == alone  # every step, exact
        got = load_file(str(root / together / f"step_{STEPS}" / name / "model.safetensors"))
        want = load_file(str(root / name / f"step_{STEPS}" / "model.safetensors"))
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (name, key)
        # the export names the draft's own config, as its run alone does
        config = json.loads((root / together / f"step_{STEPS}" / name / "config.json").read_text())
        assert (
            config["target"]["config_hash"]
            == json.loads((root / name / f"step_{STEPS}" / "config.json").read_text())["target"]["config_hash"]
        )
        logged = losses_by_step(root / together / "metrics.jsonl", name)
        assert [loss for _, loss in logged] == alone


def test_one_slot_commits_every_draft_and_keep_last_holds_for_the_set(runs):
    root, results = runs
    slots = committed_slots(root / "three" / "ckpt")
    assert [s.name for s in slots] == [f"step_{STEPS - 2}", f"step_{STEPS - 1}", f"step_{STEPS}"]  # keep_last: 3
    for slot in slots:
        record = verify_slot(slot)
        assert list(record["drafts"]) == ["g", "e3", "ds"] and record["step"] == int(slot.name[5:])
        assert sorted(p.name for p in slot.iterdir() if p.is_dir()) == ["ds", "e3", "g"]
        for name in ("g", "e3", "ds"):
            assert (slot / name / "draft_frozen.safetensors").is_file()
            assert f"{name}/mp_rank_00_model_states.pt" in record["files"]
    line = next(line for line in results["lines"] if "drafts from one target pass" in line)
    assert line.startswith("specdraft: 3 drafts from one target pass (g (glide draft), ") and "GiB per device" in line


def test_resume_falls_back_to_the_older_slot_and_continues_every_draft_exactly(runs, tiny_target_dir):
    """The two newest slots each lose one draft's file: the run goes back to step 3 and takes
    updates 4 and 5 again, every draft's weights exactly as before (update 5 runs at the rate the
    loaded schedule gives: the optimizer's own state brings back only update 4's)."""
    root, results = runs
    run_dir = root / "three_resumed"
    shutil.copytree(root / "three", run_dir)
    for step, name in ((STEPS, "e3"), (STEPS - 1, "g")):
        damaged = run_dir / "ckpt" / f"step_{step}" / name / "mp_rank_00_model_states.pt"
        damaged.write_bytes(damaged.read_bytes()[:-8])
    lines = []
    from specdraft.train.loop import train

    cfg = load_config(
        None,
        run_overrides(
            tiny_target_dir,
            root / "data",
            run_dir,
            root / "cache",
            max_steps=STEPS,
            save_steps=1,
            keep_last=3,
            drafts=sections(["g", "e3", "ds"]),
        ),
    )
    resumed = train(cfg, log=lines.append)
    assert sum(line.startswith("resume: skipped") for line in lines) == 2, lines
    assert any(line == f"resumed from {run_dir / 'ckpt' / f'step_{STEPS - 2}'} at step {STEPS - 2}" for line in lines)
    for name in ("g", "e3", "ds"):  # the whole set went back, and continued as before
        assert resumed.draft_losses[name] == results["three"].draft_losses[name][STEPS - 2 :]
        exports = [load_file(str(root / "three" / f"step_{step}" / name / "model.safetensors")) for step in (3, 4, 5)]
        for before, after in zip(exports, exports[1:]):  # each update moved every trained tensor
            assert all(not torch.equal(before[key], after[key]) for key in trainable_names(cfg, name)), name
        again = load_file(str(run_dir / f"step_{STEPS}" / name / "model.safetensors"))
        assert all(torch.equal(again[key], exports[-1][key]) for key in exports[-1]), name
    # another set of drafts does not resume these slots
    cfg = load_config(
        None,
        run_overrides(
            tiny_target_dir, root / "data", run_dir, root / "cache", max_steps=STEPS, drafts=sections(["g", "e3"])
        ),
    )
    with pytest.raises(SpecdraftError, match="saved a run of the drafts g, e3, ds; this run trains the drafts g, e3"):
        train(cfg, log=lambda *a: None)
    cfg = load_config(None, run_overrides(tiny_target_dir, root / "data", run_dir, root / "cache", max_steps=STEPS))
    with pytest.raises(SpecdraftError, match="this run trains one draft"):
        train(cfg, log=lambda *a: None)


def trainable_names(cfg, name: str) -> list:
    """The names of a draft's trained tensors (its buffers and frozen parameters never move)."""
    from specdraft.drafts.registry import build_draft
    from specdraft.target.model import load_target_config

    with torch.device("meta"):
        draft = build_draft(draft_view(cfg, name).draft, load_target_config(cfg.target))
    return [key for key, param in draft.named_parameters() if param.requires_grad]


# -- the memory model ------------------------------------------------------------------------------


def test_the_memory_model_counts_one_target_every_draft_and_the_union_of_captures(tiny_target_dir, data_dir, tmp_path):
    from specdraft.target.model import load_target_config
    from specdraft.train.memory import estimate_peak, estimate_run_peak

    target = load_target_config(tiny_target_dir)
    cfg = load_config(
        None,
        [
            *run_overrides(tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache"),
            drafts_value(["g", "e3", "ds"]),
        ],
    )
    together = estimate_run_peak(target, cfg, world_size=1)
    alone = {name: estimate_peak(target, draft_view(cfg, name), world_size=1) for name in ("g", "e3", "ds")}
    assert together.parts["target weights"] == alone["g"].parts["target weights"]  # once
    for name, est in alone.items():
        for part in ("draft weights", "draft grads", "optimizer (fp32 master + Adam m, v)"):
            assert together.parts[f"{name}: {part}"] == est.parts[part]
    # EAGLE-3 and DSpark read the same layers: their union is less than the sum, at least the largest
    captures = [est.parts["capture features"] for est in alone.values()]
    assert max(captures) <= together.parts["capture features"] < sum(captures)
    assert max(e.total for e in alone.values()) < together.total < sum(e.total for e in alone.values())


# -- SIGKILL during saves --------------------------------------------------------------------------


def test_sigkill_during_saves_of_three_drafts_resumes_every_draft_as_uninterrupted(tiny_target_dir, data_dir, tmp_path):
    names = ["g", "e3", "df"]
    steps = 16
    extra = dict(max_steps=steps, save_steps=1, keep_last=2, drafts=sections(names))
    straight = train_run(tiny_target_dir, data_dir, tmp_path, "straight", **extra)
    run_dir = tmp_path / "crashy"
    (tmp_path / "overrides.json").write_text(
        json.dumps(run_overrides(tiny_target_dir, data_dir, run_dir, tmp_path / "cache", **extra))
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "crash_script.py"),
            tmp_path / "overrides.json",
            run_dir,
            "6",
            str(free_port()),
            "3",
        ],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # a fast machine may finish the run before a late kill: most trials must still have died mid-run
    assert sum(t["killed"] for t in report["trials"]) >= 4 and report["final_exit"] == 0, report["trials"]
    assert sum(bool(t["interrupted"]) for t in report["trials"]) >= 1, report["trials"]  # killed inside a save
    assert not any(" crashed " in line for line in report["log"]), report["log"]
    assert any("resumed from" in line for line in report["log"]), report["log"]
    assert report["final"]["latest"] == f"step_{steps}"
    for slot in committed_slots(run_dir / "ckpt"):  # every committed slot holds the whole set
        assert list(verify_slot(slot)["drafts"]) == names
    # every loss any trainer logged, before a kill or after a resume, is the uninterrupted run's
    for name in names:
        logged = losses_by_step(run_dir / "metrics.jsonl", name)
        assert {step for step, _ in logged} == set(range(1, steps + 1))
        assert all(loss == straight.draft_losses[name][step - 1] for step, loss in logged), name


# -- ZeRO-3 and the in-training tau ------------------------------------------------------------------


def test_zero3_several_drafts_train_as_alone_and_each_tau_is_logged_under_its_name(
    tiny_target_dir, tiny_data, data_dir, tmp_path
):
    """At ZeRO-3 the target is replicated outside the drafts' engines; each draft still trains as
    it does alone (its engine partitions it alone), and the tau of each is measured."""
    common = dict(
        max_steps=2,
        save_steps=2,
        zero_stage=3,
        target_placement="replicated",
        eval_steps=2,
        eval_prompts=tiny_data.prompts_file,
    )
    together = train_run(tiny_target_dir, data_dir, tmp_path, "together", drafts=sections(["g", "e3"]), **common)
    rows = [json.loads(line) for line in open(tmp_path / "together" / "metrics.jsonl")]
    for name in ("g", "e3"):
        alone = train_run(tiny_target_dir, data_dir, tmp_path, name, **alone_overrides(name), **common)
        assert together.draft_losses[name] == alone.losses and len(alone.losses) == 2
        got = load_file(str(tmp_path / "together" / "step_2" / name / "model.safetensors"))
        want = load_file(str(tmp_path / name / "step_2" / "model.safetensors"))
        assert all(torch.equal(got[key], want[key]) for key in want)
        taus = [row[f"{name}/eval/tau"] for row in rows if f"{name}/eval/tau" in row]
        alone_taus = [
            json.loads(line)["eval/tau"] for line in open(tmp_path / name / "metrics.jsonl") if "eval/tau" in line
        ]
        assert len(taus) == 1 and taus == alone_taus
