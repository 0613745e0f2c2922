"""Config mistakes: one line on stderr naming the key, exit code 2, nothing written."""

import json
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.config import load_config
from specdraft.drafts.registry import FAMILIES


@pytest.fixture
def valid_config(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    path = tmp_path / "run.yaml"
    path.write_text(
        f"target: {tmp_path / 'target'}\ndata_files: {tmp_path}/*.jsonl\n"
        f"output_dir: {tmp_path / 'out'}\ndraft:\n  max_lag: 3\n"
    )
    return path


def run_cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize(
    "override, expected",
    [
        ("max_stepz=3", "unknown key 'max_stepz' (did you mean 'max_steps'?)"),
        ("draft.max_lagg=2", "unknown key 'draft.max_lagg' (did you mean 'draft.max_lag'?)"),
        ("learning_rate=fast", "key 'learning_rate': value 'fast' is not a valid float"),
        ("zero_stage=4", "key 'zero_stage': 4 is not one of 0, 1, 2, 3"),
        ("precision=fp8", "key 'precision': 'fp8' is not one of fp32, bf16"),
        (
            "precision=fp16",
            "key 'precision': fp16 is not supported for training (the chunked losses' gradients "
            "would underflow before loss scaling); use bf16",
        ),
        ("data_files=/no/such/file.jsonl", "key 'data_files': no file matches /no/such/file.jsonl"),
        ("target=/no/such/dir", "key 'target': directory not found: /no/such/dir"),
        ("max_steps", "override 'max_steps': expected key=value"),
        (
            "export_formats=[speculators]",
            "key 'export_formats': 'speculators' is not a serving format of draft.type 'glide'",
        ),
    ],
)
def test_bad_config_is_one_line_and_exit_2(valid_config, capsys, override, expected):
    code, err = run_cli(capsys, "train", str(valid_config), override)
    assert code == 2
    assert err.count("\n") == 0 and expected in err
    assert not (valid_config.parent / "out").exists()  # nothing was written


def test_unknown_key_in_yaml_and_broken_yaml(valid_config, tmp_path, capsys):
    valid_config.write_text(valid_config.read_text() + "warmup_ratio: 0.1\n")
    code, err = run_cli(capsys, "train", str(valid_config))
    assert code == 2 and "unknown key 'warmup_ratio'" in err and "warmup_proportion" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("target: [unclosed\n")
    code, err = run_cli(capsys, "train", str(broken))
    assert code == 2 and f"{broken}:2:1: not valid YAML: did not find expected" in err and err.count("\n") == 0
    code, err = run_cli(capsys, "train", str(tmp_path / "missing.yaml"))
    assert code == 2 and "config file not found" in err


def test_valid_config_merges_yaml_and_overrides(valid_config):
    cfg = load_config(str(valid_config), ["max_steps=7", "draft.sliding_window=64", "resume=no"])
    assert (cfg.max_steps, cfg.draft.sliding_window, cfg.draft.max_lag, cfg.resume) == (7, 64, 3, "no")
    assert cfg.zero_stage == 2 and cfg.learning_rate == 5e-4  # schema defaults (LongSpec's lr)


SHIPPED_CONFIGS = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_shipped_configs_are_valid(name, tmp_path):
    from helpers import REPO

    (tmp_path / "t").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    cfg = load_config(
        str(REPO / "configs" / name),
        [f"target={tmp_path / 't'}", f"data_files={tmp_path}/d.jsonl", "eval_prompts=null"],
    )
    family = next((f for f in ("peagle", "eagle3", "dflash2", "dflash", "dspark", "mtp") if f in name), "glide")
    assert cfg.draft.type == family and cfg.max_seq_length >= 256


GPU_CONFIGS = [name for name in SHIPPED_CONFIGS if not name.startswith("demo")]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_a_shipped_gpu_config_saves_at_least_every_134m_tokens(name, tmp_path):
    """A crash loses at most the tokens since the last save: at the GPUs the config's launch line
    names, a save comes every 2**27 tokens (134M) or sooner, as its comment says."""
    import re

    from helpers import REPO

    text = (REPO / "configs" / name).read_text()
    gpus = int(re.search(r"--num_gpus (\d+)", text).group(1))
    (tmp_path / "t").mkdir()
    (tmp_path / "d.jsonl").write_text("{}\n")
    cfg = load_config(str(REPO / "configs" / name), [f"target={tmp_path / 't'}", f"data_files={tmp_path}/d.jsonl"])
    per_step = gpus * cfg.per_device_batch_size * cfg.gradient_accumulation_steps * cfg.max_seq_length
    assert cfg.save_steps * per_step <= 2**27, f"{name}: a save every {cfg.save_steps * per_step:,} tokens"
    comment = re.search(r"save_steps: \d+ +# a step: (.*)", text).group(1)
    assert f"{per_step / 1e6:.1f}M tokens" in comment and f"~{cfg.save_steps * per_step / 1e6:.0f}M" in comment


def test_deepspeed_launcher_local_rank_argument_is_accepted(valid_config, capsys):
    code, err = run_cli(capsys, "train", str(valid_config), "max_stepz=1", "--local_rank=3")
    assert code == 2 and "max_stepz" in err  # parsed fine; the config error is what is reported


@pytest.mark.parametrize(
    "given, family, owner",
    [
        ("draft.block_size=4", "glide", "dflash, dspark, dflash2"),
        ("draft.ttt_steps=3", "dflash", "eagle3"),
        ("draft.max_lag=2", "eagle3", "glide"),
        ("draft.target_layers=[1]", "glide", "eagle3, dflash, dspark, peagle, dflash2"),
        ("draft.markov_rank=8", "dflash", "dspark"),
        ("draft.selector_top_k=8", "dspark", "dflash2"),
    ],
)
def test_a_key_of_another_family_is_refused(valid_config, capsys, given, family, owner):
    valid_config.write_text(valid_config.read_text().replace("draft:\n  max_lag: 3\n", ""))
    code, err = run_cli(capsys, "train", str(valid_config), f"draft.type={family}", given)
    key = given.split("=")[0]
    assert code == 2 and err.count("\n") == 0
    assert f"key '{key}': not a key of draft.type '{family}' (it belongs to {owner})" in err
    assert not (valid_config.parent / "out").exists()


def test_a_foreign_key_in_yaml_is_refused_too(valid_config, capsys):
    valid_config.write_text(valid_config.read_text() + "  block_size: 4\n")
    code, err = run_cli(capsys, "train", str(valid_config))
    assert code == 2 and "key 'draft.block_size': not a key of draft.type 'glide'" in err


def test_config_hash_and_saved_config_hold_the_family_keys_only(valid_config, tmp_path):
    """Another family's defaults are not part of a draft's identity: the hash ignores them, and
    the saved config lists only `type` and the family's own keys (it loads back as it was)."""
    import dataclasses
    from omegaconf import OmegaConf

    from specdraft.config import config_hash, save_config
    from specdraft.drafts.registry import FAMILIES

    cfg = load_config(str(valid_config))
    before = config_hash(cfg)
    cfg.draft.block_size = cfg.draft.block_size + 1  # a DFlash key on a GLIDE config
    assert config_hash(cfg) == before
    cfg.draft.max_lag = 2  # GLIDE's own key
    assert config_hash(cfg) != before
    save_config(cfg, tmp_path / "saved.yaml")
    saved = OmegaConf.load(tmp_path / "saved.yaml")
    own = {f.name for f in dataclasses.fields(FAMILIES["glide"].options)}
    assert set(saved.draft) == own | {"type"} and saved.draft.max_lag == 2
    assert load_config(str(tmp_path / "saved.yaml")).draft.max_lag == 2


@pytest.mark.parametrize("model_type, biased", [("llama", False), ("qwen2", True)])
def test_a_key_added_later_keeps_older_checkpoints_resumable_where_they_are_the_same_draft(
    valid_config, model_type, biased
):
    """GLIDE's draft.attention_bias came after GLIDE checkpoints existed, all without biases. Its
    default resolves against the target: without biases (a Llama target) the hash is the one a
    config without the key had, so those slots resume; with biases (Qwen2) it is another draft,
    and such a slot is refused. Gradient checkpointing changes memory only: never part of it."""
    from omegaconf import OmegaConf

    from specdraft.config import config_hash

    target = valid_config.parent / "target"
    (target / "config.json").write_text(
        json.dumps({"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2})
    )
    (target / "tokenizer.json").write_text("{}")  # a model directory has its tokenizer (checked at load)
    cfg = load_config(str(valid_config))
    now = config_hash(cfg)
    older = OmegaConf.create(OmegaConf.to_container(cfg))
    del older.draft["attention_bias"]  # a config written before the key existed
    with pytest.MonkeyPatch.context() as patch:  # its hash then: the draft's keys as they were
        patch.setattr("specdraft.drafts.glide.options.GlideSpec.identity_options", classmethod(lambda cls, o, t: o))
        before_the_key = config_hash(older)
    assert (now == before_the_key) is not biased
    cfg.draft.attention_bias = not biased  # set against the target's default: another draft
    assert config_hash(cfg) != now
    valid_config.write_text(valid_config.read_text().replace("  max_lag: 3\n", "  type: eagle3\n"))
    eagle3 = load_config(str(valid_config))
    before = config_hash(eagle3)
    eagle3.draft.gradient_checkpointing = True
    assert config_hash(eagle3) == before


@pytest.mark.parametrize("name", ["demo", "demo-eagle3", "demo-dflash", "demo-dspark", "demo-peagle", "demo-mtp"])
def test_demo_configs_are_one_copy_found_by_configs_and_the_package(name):
    from helpers import REPO

    from specdraft.config import demo_config_path

    packaged = demo_config_path(name)
    assert packaged.startswith(str(REPO / "specdraft" / "configs"))
    assert (REPO / "configs" / f"{name}.yaml").resolve() == (REPO / "specdraft" / "configs" / f"{name}.yaml")


def test_demo_config_that_does_not_exist_is_one_line(capsys):
    from specdraft.config import demo_config_path

    with pytest.raises(Exception) as err:
        demo_config_path("demo-nope")
    assert (
        "--config demo-nope: neither a packaged demo config (demo, demo-dflash, demo-dflash2, demo-dspark, demo-eagle3, demo-mtp, demo-peagle"
        in str(err.value)
    )


@pytest.mark.parametrize("name", ["demo", "demo-eagle3", "demo-dflash", "demo-dspark", "demo-peagle", "demo-mtp"])
def test_demo_configs_name_the_files_the_demo_build_writes(name, tiny_target_dir, tiny_data):
    """`specdraft train configs/demo*.yaml` after `specdraft demo`: its data_files glob finds the
    build's train files (checked on the tiny build, laid out like the demo's and the mtp preset's)."""
    import glob

    from omegaconf import OmegaConf

    from specdraft.demo.command import preset_of
    from specdraft.config import demo_config_path

    config = OmegaConf.load(demo_config_path(name))
    preset = preset_of(demo_config_path(name))
    for key in ("target", "eval_prompts", "data_files"):  # all three in the preset's own folder
        assert config._get_node(key)._value().startswith(f"${{specdraft_home:}}/{preset}/")
    pattern = config._get_node("data_files")._value()
    build = Path(tiny_target_dir).parent  # <home>/tiny, as <home>/<preset> for the config's preset
    found = sorted(glob.glob(pattern.replace(f"${{specdraft_home:}}/{preset}", str(build))))
    assert found and found == sorted(str(f) for f in tiny_data.train_files)


def test_every_family_has_a_label_and_a_packaged_demo_config_of_its_own():
    """What the demo, the acceptance bench and the tables read from the registry alone."""
    from omegaconf import OmegaConf

    from specdraft.config import family_demo_configs
    from specdraft.drafts.registry import FAMILIES

    from specdraft.demo.command import preset_of
    from specdraft.demo.presets import get_preset

    configs = family_demo_configs()
    assert set(configs) == set(FAMILIES)
    for family, cls in FAMILIES.items():
        assert cls.label and cls.label not in {c.label for f, c in FAMILIES.items() if f != family}
        assert OmegaConf.load(configs[family]).draft.get("type", "glide") == family
        # its config's target is a preset of an architecture the family drafts for (MTP: the mtp
        # preset's Qwen3-Next with its native layer; the others: the demo's Llama)
        architecture = get_preset(preset_of(configs[family])).architecture
        assert cls.target_model_types is None or architecture in cls.target_model_types, (family, architecture)


def test_config_command_prints_the_resolved_config_as_a_run_records_it(valid_config, capsys, tmp_path):
    """`specdraft config` prints what save_config writes into a run's config.yaml: every default,
    the overrides, the family's own draft keys only; it writes nothing."""
    from omegaconf import OmegaConf

    from specdraft.config import save_config

    code = main(["config", str(valid_config), "max_steps=7", "draft.sliding_window=64"])
    printed = capsys.readouterr().out
    assert code == 0
    save_config(load_config(str(valid_config), ["max_steps=7", "draft.sliding_window=64"]), tmp_path / "config.yaml")
    assert printed == (tmp_path / "config.yaml").read_text()
    shown = OmegaConf.create(printed)
    assert shown.max_steps == 7 and shown.keep_last == 2 and shown.seed == 42 and shown.eval_steps == -1
    assert (shown.draft.type, shown.draft.sliding_window, shown.draft.max_lag) == ("glide", 64, 3)
    assert "ttt_steps" not in shown.draft and "block_size" not in shown.draft
    assert shown.wandb.mode == "offline" and shown.resume == "auto"
    assert not (valid_config.parent / "out").exists()


def test_config_command_refuses_like_train_in_one_line(valid_config, capsys):
    code = main(["config", str(valid_config), "max_stepz=3"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and "unknown key 'max_stepz' (did you mean 'max_steps'?)" in captured.err


def test_train_help_names_the_config_command_and_the_reference(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "specdraft config CONFIG [key=value ...]" in text and "docs/config-reference.md" in text


def test_demo_help_names_every_packaged_demo_config(capsys):
    from specdraft.config import family_demo_configs

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps at hyphens
    names = sorted(Path(path).stem for path in family_demo_configs().values())
    assert len(names) == len(FAMILIES) and f"({','.join(names)})" in text


@pytest.mark.parametrize(
    "command",
    ["", "train", "capture", "config", "data", "demo", "inspect", "export", "consolidate", "eval", "regenerate"],
)
def test_help_imports_neither_torch_nor_deepspeed_nor_transformers(command):
    """`specdraft [COMMAND] --help` answers at once: the heavy imports happen inside the commands."""
    import subprocess
    import sys

    probe = (
        "import sys\nfrom specdraft.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *command.split(), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "usage: specdraft" in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


@pytest.mark.parametrize(
    "command, with_target_config, heavy",
    [
        ("config", True, ("deepspeed",)),
        ("config", False, ("torch", "deepspeed", "transformers")),
        ("data", True, ("deepspeed",)),
    ],
)
def test_config_and_data_run_without_the_training_imports(
    command, with_target_config, heavy, tiny_target_dir, data_dir, tmp_path
):
    """`specdraft config` (the resolved config, validated in full against the target) imports no
    DeepSpeed and no module of ours that needs torch: torch comes only with transformers' config
    classes, which read the target's config.json (a directory without one: no torch at all);
    `specdraft data` (the token cache) imports no DeepSpeed. Run on a real config."""
    import shutil
    import subprocess
    import sys

    from helpers import run_overrides

    target = tiny_target_dir
    if not with_target_config:  # a model directory before its config.json is there
        target = tmp_path / "target"
        shutil.copytree(tiny_target_dir, target)
        (target / "config.json").unlink()
    overrides = run_overrides(target, data_dir, tmp_path / "out", tmp_path / "cache")
    probe = (
        "import sys\nfrom specdraft.cli import main\ncode = main(sys.argv[1:])\n"
        f"print(code, sorted(m for m in {heavy!r} if m in sys.modules), "
        "sorted(m for m, module in list(sys.modules.items()) if m.startswith('specdraft') and "
        "'torch' in vars(module)))"
    )
    config = tmp_path / "run.yaml"
    config.write_text("draft:\n  type: glide\n")
    proc = subprocess.run(
        [sys.executable, "-c", probe, command, str(config), *overrides], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    ours = "[]" if command == "config" else None  # data packs its cache with torch
    code, imported, torch_modules = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (code, imported) == ("0", "[]"), proc.stdout[-2000:]
    assert ours is None or torch_modules == ours, torch_modules


def test_a_missing_eval_prompts_file_matters_only_when_tau_is_measured(tiny_target_dir, data_dir, tmp_path):
    """eval_steps <= 0 never reads eval_prompts: a config naming a file not on this machine loads."""
    from helpers import run_overrides
    from specdraft.errors import SpecdraftError

    base = run_overrides(
        tiny_target_dir, data_dir, tmp_path / "out", tmp_path / "cache", eval_prompts=tmp_path / "missing.jsonl"
    )
    assert load_config(None, [*base, "eval_steps=-1"]).eval_steps == -1
    with pytest.raises(SpecdraftError, match="key 'eval_prompts': file not found"):
        load_config(None, [*base, "eval_steps=10"])
