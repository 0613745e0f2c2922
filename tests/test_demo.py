"""The demo assets: a genuine HF target directory and a dataset of the target's own answers."""

import dataclasses
import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from helpers import random_llama
from specdraft.demo.presets import PRESETS
from specdraft.demo.target import build_target
from specdraft.demo.assets import ensure_demo_assets
from specdraft.demo.assets import SEED
from specdraft.demo.cache import stamp_matches as _matches
from specdraft.demo.cache import STAMP, building, read_stamp
from specdraft.demo.corpus import PROMPT_PREFIX, SourceFile, extract_functions
from specdraft.demo.dataset import build_dataset, chat_prompt, data_inputs, regenerate
from specdraft.demo.presets import get_preset
from specdraft.demo.machine import this_cpu
from specdraft.demo.target import pretrain, target_inputs
from specdraft.errors import SpecdraftError


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def _rows(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- the target directory ---------------------------------------------------------------------


def test_target_loads_with_plain_transformers(model, tokenizer):
    p = PRESETS["tiny"]
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (p.hidden_size, p.num_hidden_layers)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA, like real targets
    assert not cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tokenizer)
    ids = tokenizer("def f(x):\n    return x", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_target_is_sharded_safetensors_with_index(tiny_target_dir, model):
    shards = sorted(tiny_target_dir.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert not (tiny_target_dir / "model.safetensors").exists()
    index = json.loads((tiny_target_dir / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(model.state_dict())
    assert {tiny_target_dir / name for name in weight_map.values()} == set(shards)
    for shard in shards:  # every tensor lives where the index says
        with safe_open(shard, "pt") as f:
            assert all(weight_map[key] == shard.name for key in f.keys())


def test_target_was_trained(tiny_target_dir):
    stamp = json.loads((tiny_target_dir / STAMP).read_text())
    # an untrained model sits at ln(vocab) ~ 6.2 nats; training must have moved it well below
    assert stamp["final_loss"] < 5.5


# --- tokenizer and chat template -------------------------------------------------------------


def test_chat_template_renders_and_round_trips(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def f(x):\n    \"\"\"Return x, é ✓.\"\"\""},
        {"role": "assistant", "content": "    return x"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\ndef f(x):\n    \"\"\"Return x, é ✓.\"\"\"<|im_end|>\n"
        "<|im_start|>assistant\n    return x<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    # every special marker is one token, never spelled out in bytes
    for token in ("<|bos|>", "<|im_start|>", "<|im_end|>"):
        assert ids.count(tokenizer.convert_tokens_to_ids(token)) == text.count(token)
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith(prompt)  # the answer's tokens follow the generation prompt


def test_chat_template_rejects_unknown_roles(tokenizer):
    with pytest.raises(Exception, match="unknown chat role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_generation_stops_at_end_of_turn(model, tokenizer):
    eos = model.generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    assert tokenizer.eos_token_id in eos


# --- the dataset -----------------------------------------------------------------------------


def test_dataset_files_are_chat_jsonl(tiny_data):
    assert len(tiny_data.train_files) >= 2
    users = []
    for path in tiny_data.train_files:
        rows = _rows(path)
        assert rows, path
        for row in rows:
            roles = [turn["role"] for turn in row["conversations"]]
            assert roles == ["user", "assistant"]
            user, assistant = (turn["content"] for turn in row["conversations"])
            assert user.startswith((PROMPT_PREFIX + "def ", PROMPT_PREFIX + "async def "))
            assert assistant.strip()
            users.append(user)
    assert len(set(users)) == len(users)

    prompts = [row["prompt"] for row in _rows(tiny_data.prompts_file)]
    assert prompts and all(p.startswith(PROMPT_PREFIX) for p in prompts)
    assert not set(prompts) & set(users)  # held out


def test_answers_are_the_targets_own_greedy_continuation(tiny_data, model, tokenizer):
    rows = _rows(tiny_data.train_files[0])[:3]
    special = set(tokenizer.all_special_ids)
    for row in rows:
        user, assistant = (turn["content"] for turn in row["conversations"])
        ids = tokenizer(chat_prompt(tokenizer, user), return_tensors="pt", add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=PRESETS["tiny"].max_new_tokens, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        cut = next((k for k, t in enumerate(new) if t in special), len(new))
        assert tokenizer.decode(new[:cut]) == assistant


def test_sampled_answers_are_seeded_and_differ_from_greedy(tiny_data, model, tokenizer):
    prompts = [row["conversations"][0]["content"] for row in _rows(tiny_data.train_files[0])[:8]]
    p = PRESETS["tiny"]

    def answers(temperature, seed=SEED):
        return regenerate(
            model,
            tokenizer,
            prompts,
            p.max_new_tokens,
            p.generate_batch,
            log=lambda m: None,
            temperature=temperature,
            seed=seed,
        )

    rng = torch.get_rng_state()
    sampled = answers(0.7)
    assert torch.equal(torch.get_rng_state(), rng)  # its own seeded generator state, the caller's untouched
    assert answers(0.7) == sampled  # the same seed: the same answers
    assert answers(0.7, seed=SEED + 1) != sampled
    greedy = answers(0.0)
    assert sum(s != g for s, g in zip(sampled, greedy)) >= len(prompts) // 2


def test_sampled_answers_are_a_dataset_of_their_own(tiny_target_dir, tiny_data, tmp_path):
    greedy_stamp = read_stamp(tiny_data.prompts_file.parent)
    target_stamp = read_stamp(tiny_target_dir)
    greedy_key, sampled_key = data_inputs("tiny", SEED, target_stamp), data_inputs("tiny", SEED, target_stamp, 0.7)
    assert _matches(greedy_stamp, greedy_key) and not _matches(greedy_stamp, sampled_key)
    assert not _matches({**greedy_stamp, **sampled_key}, greedy_key)

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "target").symlink_to(tiny_target_dir)  # the session's target, not rebuilt
    messages = []
    target_dir, data = ensure_demo_assets(tmp_path, preset="tiny", log=messages.append, answer_temperature=0.7)
    assert data.prompts_file.parent == tmp_path / "tiny" / "data-T0.7"
    assert read_stamp(data.prompts_file.parent)["answer_temperature"] == 0.7
    assert data.prompts_file.read_text() == tiny_data.prompts_file.read_text()  # the same held-out prompts
    sampled = [row for path in data.train_files for row in _rows(path)]
    greedy = [row for path in tiny_data.train_files for row in _rows(path)]
    assert sampled != greedy
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(SpecdraftError, match="answer temperature"):
            ensure_demo_assets(tmp_path, preset="tiny", answer_temperature=bad)
    messages.clear()
    assert ensure_demo_assets(tmp_path, preset="tiny", log=messages.append, answer_temperature=0.7)[1] == data
    assert sum("reusing" in m for m in messages) == 2


# --- progress on stderr ----------------------------------------------------------------------


def test_the_answers_are_generated_under_a_progress_bar(tiny_target_dir, tmp_path, monkeypatch, capsys):
    """The demo's longest build (smollm2: 1,000 answers, ~20 minutes on 2 cores) shows answers done of
    the prompts, tokens/s and the time left; progress_bar=False keeps a build quiet."""
    few = dataclasses.replace(get_preset("tiny"), name="tiny-few", train_rows=6, prompt_rows=2, max_new_tokens=4)
    monkeypatch.setitem(PRESETS, few.name, few)
    build_dataset(tiny_target_dir, tmp_path / "shown", few.name, SEED, log=lambda m: None)
    bar = capsys.readouterr().err.split("\r")[-1]  # the bar as it was left
    assert re.fullmatch(r"100%\|.*\| 6/6 answers \[\d\d:\d\d<\d\d:\d\d, \d+ tok/s\]\n", bar), bar
    build_dataset(tiny_target_dir, tmp_path / "quiet", few.name, SEED, log=lambda m: None, progress_bar=False)
    assert "answers" not in capsys.readouterr().err


def test_the_target_pretrains_under_a_progress_bar(capsys):
    """Its steps done of train_steps, with the loss, tokens/s and the time left; the log lines go above it."""
    p = dataclasses.replace(get_preset("tiny"), train_steps=3, batch_size=2, seq_len=16, log_every=3, warmup_steps=1)
    stream = torch.randint(5, 200, (400,), generator=torch.Generator().manual_seed(0))
    logged = []
    model = random_llama(vocab=256, max_positions=256, init=0.02).requires_grad_()
    pretrain(model, stream, p, 0, log=logged.append)
    bar = capsys.readouterr().err.split("\r")[-1]
    assert re.fullmatch(
        r"\[demo target\] pre-training: 100%\|.*\| 3/3 \[.*<00:00, .*loss \d\.\d+, \d+ tok/s\]\n", bar
    ), bar
    assert len(logged) == 1 and logged[0].startswith("[demo target] step 3/3 loss")


# --- caching ---------------------------------------------------------------------------------


def test_second_ensure_reuses_the_cache(tiny_target_dir, tiny_data):
    files = [p for p in tiny_target_dir.parent.rglob("*") if p.is_file()]
    before = {p: os.stat(p).st_mtime_ns for p in files}
    messages = []
    target_dir, data = ensure_demo_assets(tiny_target_dir.parents[1], preset="tiny", log=messages.append)
    assert (target_dir, data) == (tiny_target_dir, tiny_data)
    assert {p: os.stat(p).st_mtime_ns for p in files} == before
    assert sum("reusing" in m for m in messages) == 2
    leftovers = [p for p in tiny_target_dir.parent.iterdir() if p.name.startswith(".")]
    assert not leftovers  # no temp build dirs


def test_a_foreign_directory_in_the_cache_is_not_deleted(tmp_path):
    foreign = tmp_path / "tiny" / "target"
    foreign.mkdir(parents=True)
    (foreign / "mine.txt").write_text("user data")
    with pytest.raises(SpecdraftError, match="not built by"):
        ensure_demo_assets(tmp_path, preset="tiny", log=lambda m: None)
    assert (foreign / "mine.txt").read_text() == "user data"


def test_failed_build_leaves_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError):
        with building(tmp_path / "out", {"kind": "x"}) as tmp:
            (tmp / "half.bin").write_bytes(b"0")
            raise RuntimeError("crash mid-build")
    assert list(tmp_path.iterdir()) == []


def test_same_seed_builds_the_same_target_and_its_stamp_names_the_cpu(tiny_target_dir, tmp_path):
    again = build_target(tmp_path / "again", preset="tiny", seed=SEED, log=lambda m: None, progress_bar=False)
    for shard in sorted(tiny_target_dir.glob("*.safetensors")):
        assert (again / shard.name).read_bytes() == shard.read_bytes()
    tokenizer_json = (tiny_target_dir / "tokenizer.json").read_text()
    assert (again / "tokenizer.json").read_text() == tokenizer_json
    cpu = read_stamp(again)["cpu"]  # recorded beside the build time, not part of the cache key
    assert cpu == this_cpu()
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability() and cpu["threads"] == torch.get_num_threads()
    assert set(target_inputs("tiny", SEED)) == {"kind", "preset", "seed", "python"}


def test_a_bench_target_pretrained_in_bf16_is_stale_and_other_presets_keep_their_cache():
    bench = target_inputs("bench", SEED)
    bf16_built = dict(bench, preset=dict(bench["preset"], bf16_autocast=True))  # its stamp's key before fp32
    assert not _matches(bf16_built, bench)
    for preset in PRESETS.values():  # every field: a changed preset is a changed cache key
        recorded = dataclasses.asdict(preset)
        if preset.architecture == "llama":  # added later: the stamps built before it stay valid
            del recorded["architecture"]
        assert preset.fingerprint() == recorded
        assert "bf16_autocast" not in preset.fingerprint()  # demo and tiny stamps never recorded it
        other = dataclasses.replace(preset, architecture="qwen3_next" if preset.architecture == "llama" else "llama")
        assert other.fingerprint() != preset.fingerprint()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_pretrains_in_fp32(name):
    """One recipe on every CPU: no bf16 matmul (on an AVX2-only CPU one runs ~47x slower)."""
    p = dataclasses.replace(get_preset(name), train_steps=1, batch_size=2, seq_len=16, log_every=1, warmup_steps=1)
    model = random_llama(vocab=256, max_positions=256, init=0.02).requires_grad_()
    dtypes = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, args, out: dtypes.add(out.dtype))
    stream = torch.randint(5, 200, (400,), generator=torch.Generator().manual_seed(0))
    pretrain(model, stream, p, 0, log=lambda m: None, progress_bar=False)
    assert dtypes == {torch.float32}
    assert all(w.dtype == torch.float32 for w in model.parameters())


def test_unknown_preset_is_a_user_error(tmp_path):
    with pytest.raises(SpecdraftError, match="unknown demo preset"):
        ensure_demo_assets(tmp_path, preset="huge")


# --- prompts from source ---------------------------------------------------------------------


def test_functions_split_into_signature_docstring_and_body():
    source = SourceFile(
        "m.py",
        '''
class C:
    def method(self, a,
               b=1):
        """Add.

        Longer text.
        """
        # a comment
        return a + b

def no_doc(x):
    return x

def one_line(x): "Doc."; return x

async def coro():
    "Doc."
    await thing()
''',
    )
    found = {f.qualname: f for f in extract_functions([source])}
    assert sorted(found) == ["m.py:C.method", "m.py:coro"]
    method = found["m.py:C.method"]
    assert method.prompt == (
        PROMPT_PREFIX + 'def method(self, a,\n           b=1):\n    """Add.\n\n    Longer text.\n    """'
    )
    assert method.answer == "    # a comment\n    return a + b"
    assert found["m.py:coro"].answer == "    await thing()"


# --- the demo command: its run, and what it refuses before building anything -----------------


@pytest.fixture
def no_build(monkeypatch):
    """`specdraft demo` whose builds fail the test: a refusal must come before any of them."""
    from specdraft.demo import command

    def build(*args, **kwargs):
        raise AssertionError("the demo built its assets before refusing")

    for name in ("ensure_demo_assets", "ensure_held_out_prompts", "ensure_text_data"):
        monkeypatch.setattr(command, name, build)


@pytest.mark.parametrize(
    "argv, run_dir",
    [
        ([], "runs/demo"),  # the config's own preset and greedy answers: its output_dir, as ever
        (["--preset", "tiny"], "runs/demo-tiny"),
        (["--config", "demo-eagle3", "--preset", "tiny"], "runs/demo-eagle3-tiny"),
        (["--preset", "tiny", "--data", "text"], "runs/demo-tiny-text"),
        (["--answer-temperature", "0.7"], "runs/demo-T0.7"),
        (["--preset", "tiny", "output_dir=mine"], "mine"),  # given: it wins
    ],
)
def test_each_preset_and_data_trains_in_a_run_of_its_own(argv, run_dir, tiny_assets, tmp_path, monkeypatch):
    """After `make demo` (runs/demo), `demo --preset smollm2` must not resume runs/demo's checkpoints
    against its own target, nor a run of answers on text or sampled answers (refused, after the build)."""
    from specdraft.cli import main
    from specdraft.demo import command

    trained = []
    target_dir, data = tiny_assets  # whatever the preset
    monkeypatch.setattr(command, "ensure_demo_assets", lambda **kwargs: tiny_assets)
    monkeypatch.setattr(command, "ensure_held_out_prompts", lambda **kwargs: (target_dir, data.prompts_file))
    monkeypatch.setattr(command, "ensure_text_data", lambda *args: data.train_files)
    monkeypatch.setattr(command, "train", lambda cfg: trained.append(cfg.output_dir))
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *argv]) == 0
    assert trained == [run_dir]


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["max_stesp=100"], "override 'max_stesp=100': unknown key 'max_stesp'"),
        (["learning_rate=0"], "key 'learning_rate': must be > 0, got 0"),
        (["output_dir=mine"], "output_dir mine: exists, is not empty and is not a specdraft run"),
        (["resume=gone"], "resume: gone does not exist"),
    ],
)
def test_a_command_line_the_demo_refuses_is_refused_before_any_build(
    overrides, said, tmp_path, monkeypatch, capsys, no_build
):
    from specdraft.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's own")
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    assert main(["demo", "--preset", "tiny", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "home").exists()


def test_a_run_of_another_target_is_refused_before_the_preset_is_built(
    tiny_target_dir, data_dir, tmp_path, monkeypatch, capsys, no_build
):
    """The docs' walk: a run trained against one preset's target, then `demo --preset <another>`
    into it (given output_dir=): refused at once, not after the other preset's build (smollm2: ~20
    minutes); the run's own preset goes on to its build."""
    from helpers import train_run
    from specdraft.cli import main

    run = train_run(tiny_target_dir, data_dir, tmp_path, "run", max_steps=1, save_steps=1).run_dir
    monkeypatch.setenv("SPECDRAFT_HOME", str(tiny_target_dir.parents[1]))  # the run's target is its tiny one
    capsys.readouterr()
    assert main(["demo", "--preset", "mtp", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"specdraft: error: output_dir {run}: its checkpoint step_1 trained against {tiny_target_dir}, not the "
        f"target the mtp preset builds; choose another output_dir\n"
    )
    with pytest.raises(AssertionError, match="built its assets"):  # its own preset: no refusal, the build
        main(["demo", "--preset", "tiny", f"output_dir={run}"])
