"""`specdraft regenerate`: both backends, resume, kill trials, and output that training reads."""

import json
import shutil
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specdraft.data.chat import tokenize_conversation
from specdraft.regenerate.backends import HFBackend
from specdraft.data.sources import iter_conversations
from specdraft.errors import SpecdraftError
from specdraft.regenerate.run import RegenerateConfig, regenerate
from specdraft.regenerate.writer import written_keys
from specdraft.rundir.layout import MARKER, REGENERATE, marker_text

ROWS = [
    {"prompt": "def add(a, b):"},
    {
        "id": "multi",
        "conversations": [
            {"role": "system", "content": "Write Python."},
            {"role": "user", "content": "def square(x):"},
            {"role": "assistant", "content": "a human answer"},
            {"role": "user", "content": "def cube(x):"},
            {"role": "assistant", "content": "another human answer"},
        ],
    },
    {"messages": [{"role": "user", "content": "def mean(values):"}]},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def source(tmp_path, rows):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_from(tiny_data, n):
    rows = []
    for path in tiny_data.train_files:
        for line in Path(path).read_text().splitlines():
            rows.append({"prompt": json.loads(line)["conversations"][0]["content"]})
    return rows[:n]


def out_rows(out):
    return [json.loads(line) for p in sorted(Path(out).glob("shard-*.jsonl")) for line in p.read_text().splitlines()]


def own_ids(tokenizer, message):
    """The generated ids before the stop token (the template renders the end-of-turn itself)."""
    ids = list(message["token_ids"])
    return ids[:-1] if ids and ids[-1] in tokenizer.all_special_ids else ids


def config(target, data, out, **kw):
    return RegenerateConfig(target=str(target), data=[str(data)], out=str(out), **{"max_new_tokens": 16, **kw})


def test_hf_regenerates_every_turn_on_its_own_answers_and_training_uses_its_ids(tiny_target_dir, tokenizer, tmp_path):
    data = source(tmp_path, ROWS)
    summary = regenerate(
        config(tiny_target_dir, data, tmp_path / "a", temperature=0.7, samples=2),
        log=lambda m: None,
        progress_bar=False,
    )
    rows = out_rows(tmp_path / "a")
    assert summary["rows"] + summary["errors"] == 6 and len(rows) == summary["rows"] >= 4
    multi = [r for r in rows if r["id"] == "multi"]
    for row in multi:
        roles = [m["role"] for m in row["conversations"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert "human answer" not in json.dumps(row)
        # the second answer was generated after the target's own first answer
        for answer in (row["conversations"][2], row["conversations"][4]):
            assert tokenizer.decode(own_ids(tokenizer, answer)) == answer["content"]
    # sampled with per-row seeds: a fresh run in another directory writes the same answers
    regenerate(
        config(tiny_target_dir, data, tmp_path / "b", temperature=0.7, samples=2, batch_size=1),
        log=lambda m: None,
        progress_bar=False,
    )
    key = lambda r: (r["id"], r["sample"])
    assert sorted(rows, key=key) == sorted(out_rows(tmp_path / "b"), key=key)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["sampling"]["temperature"] == 0.7 and manifest["counts"]["rows_written"] == len(rows)
    assert manifest["sources"] == [str(data)] and manifest["token_ids"] == "generated ids"
    # training reads the shards directly, and the masked tokens are exactly the generated ids
    for where, messages in iter_conversations([str(p) for p in sorted((tmp_path / "a").glob("shard-*"))]):
        ids, mask = tokenize_conversation(tokenizer, messages, where)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        expected = [
            t
            for m in messages
            if m["role"] == "assistant"  # a truncated answer ends no turn
            for t in own_ids(tokenizer, m) + ([] if m.get("truncated") else [im_end])
        ]
        assert [t for t, k in zip(ids, mask) if k] == expected


def test_rerun_does_only_what_is_missing_and_retries_errors(tiny_target_dir, tiny_data, tmp_path):
    data = source(tmp_path, prompts_from(tiny_data, 6))
    cfg = config(tiny_target_dir, data, tmp_path / "o", rows_per_shard=2)
    real = HFBackend.load(tiny_target_dir, cfg.sampling(), 4)

    class Flaky:  # the server fails two rows once
        name = "hf"
        calls = 0

        def generate(self, requests, progress=lambda n: None):
            answers = real.generate(requests, progress)
            Flaky.calls += 1
            if Flaky.calls == 1:
                for a in answers[:2]:
                    a.error, a.server_error = "server error after 5 attempts: HTTP 503", True
            return answers

    first = regenerate(cfg, Flaky(), log=lambda m: None, progress_bar=False)
    errors = [json.loads(l) for l in (tmp_path / "o" / "errors.jsonl").read_text().splitlines()]
    assert first["failed"] == 2 and all(
        "HTTP 503" in e["reason"] and e["kind"] == "failed" and e["source"] for e in errors
    )
    second = regenerate(cfg, real, log=lambda m: None, progress_bar=False)
    assert second["rows"] == 2 and second["skipped_done"] == 4 and second["errors"] == 0
    third = regenerate(cfg, real, log=lambda m: None, progress_bar=False)
    assert third["rows"] == 0 and third["skipped_done"] == 6
    assert len({(r["id"], r["sample"]) for r in out_rows(tmp_path / "o")}) == len(out_rows(tmp_path / "o")) == 6
    with pytest.raises(SpecdraftError, match="regenerated with other temperature: 0.0 there, 0.5 asked"):
        regenerate(config(tiny_target_dir, data, tmp_path / "o", temperature=0.5), real, log=lambda m: None)


def test_a_rerun_removes_the_temp_shard_a_killed_run_left_and_only_its_own_ranks(tiny_target_dir, tiny_data, tmp_path):
    """A SIGKILL between a shard's temp write and its rename leaves `.<shard>.jsonl.<random>.tmp`
    (never a shard); the rerun of that rank removes it. Another rank's temp file may be its live
    write; a file of another form is not ours to remove."""
    data = source(tmp_path, prompts_from(tiny_data, 2))
    out = tmp_path / "o"
    out.mkdir()
    (out / MARKER).write_text(marker_text(REGENERATE))  # what the killed run wrote first
    ours = out / ".shard-r000-20260101000000-abcdef-00003.jsonl.0badc0de.tmp"
    theirs = out / ".shard-r001-20260101000000-fedcba-00000.jsonl.0badc0de.tmp"
    unknown = out / ".shard-r000-notes.jsonl.mine.tmp"
    for stale in (ours, theirs, unknown):
        stale.write_text('{"id": "half a row')
    cfg = config(tiny_target_dir, data, out)
    summary = regenerate(
        cfg, HFBackend.load(tiny_target_dir, cfg.sampling(), 4), log=lambda m: None, progress_bar=False
    )
    assert summary["rows"] == 2 and not ours.exists() and theirs.exists() and unknown.exists()


def test_too_long_rows_go_to_the_errors_file(tiny_target_dir, tmp_path):
    data = source(tmp_path, [{"prompt": "x " * 200}, {"prompt": "def f():"}])
    summary = regenerate(
        config(tiny_target_dir, data, tmp_path / "o", max_length=64), log=lambda m: None, progress_bar=False
    )
    (error,) = [json.loads(l) for l in (tmp_path / "o" / "errors.jsonl").read_text().splitlines()]
    assert summary["errors"] == 1 and "too long" in error["reason"] and error["source"].endswith("in.jsonl:1")


def test_sigkill_at_random_moments_then_rerun_writes_every_row_exactly_once(tiny_target_dir, tiny_data, tmp_path):
    data = source(tmp_path, prompts_from(tiny_data, 40))
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-m",
        "specdraft",
        "regenerate",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-new-tokens",
        "24",
        "--batch-size",
        "1",
        "--concurrency",
        "1",
        "--rows-per-shard",
        "2",
        "--temperature",
        "0.7",
    ]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    rng = random.Random(0)
    killed = 0

    def shards():
        return len(list(out.glob("shard-*.jsonl")))

    for trial in range(4):
        # One row in flight (--concurrency 1), so shards come one by one. Killed once it has written 1-3 more shards, a random instant after the last one (a
        # fixed delay would miss the run on a fast machine and its start-up on a slow one)
        goal, deadline = shards() + rng.randint(1, 3), time.monotonic() + 180
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while proc.poll() is None and shards() < goal and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.03))  # the tiny target writes a 2-row shard every few tens of ms
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.wait()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    rows = out_rows(out)
    keys = [(r["id"], r["sample"]) for r in rows]
    errors = len((out / "errors.jsonl").read_text().splitlines())
    assert killed >= 3  # mid-run: each after new shards were written
    assert len(keys) == len(set(keys)) and len(keys) + errors == 40
    assert not list(out.glob("*.tmp"))
    assert len(written_keys(out)) == len(keys)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_target(tiny_target_dir):
    """`transformers serve` (transformers' own OpenAI-compatible server) on the tiny target."""
    serve = Path(sys.executable).parent / "transformers"
    pytest.importorskip("fastapi")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [str(serve), "serve", str(tiny_target_dir), "--port", str(port), "--device", "cpu", "--host", "127.0.0.1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, "transformers serve exited"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_openai_backend_against_transformers_serve(served_target, tiny_target_dir, tiny_data, tmp_path):
    """It refuses the sampling fields it does not know (422): greedy goes on without them."""
    data = source(tmp_path, prompts_from(tiny_data, 6))
    cfg = config(tiny_target_dir, data, tmp_path / "s", backend="openai", servers=[served_target], concurrency=2)
    from specdraft.regenerate.openai_backend import OpenAIBackend

    backend = OpenAIBackend(
        cfg.servers, AutoTokenizer.from_pretrained(tiny_target_dir), cfg.sampling(), concurrency=2, backoff_s=0.05
    )
    summary = regenerate(cfg, backend, log=lambda m: None, progress_bar=False)
    served = {r["id"]: r["conversations"][-1]["content"] for r in out_rows(tmp_path / "s")}
    assert summary["rows"] + summary["errors"] == 6 and summary["rows"] >= 4 and summary["tokens"] > 0
    # greedy: the server's answers are the hf backend's
    regenerate(config(tiny_target_dir, data, tmp_path / "h"), log=lambda m: None, progress_bar=False)
    local = {r["id"]: r["conversations"][-1]["content"] for r in out_rows(tmp_path / "h")}
    assert served == {k: v for k, v in local.items() if k in served}
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["backend"] == "openai" and manifest["token_ids"] == "none from some servers: text tokenised"
    assert set(manifest["server_refused_fields"][served_target + "/v1/chat/completions"]) >= {
        "top_k",
        "return_token_ids",
    }


class Crashing:
    """A backend that dies (as a SIGKILL would) at its `crash_at`-th generate call."""

    name = "hf"

    def __init__(self, real, crash_at):
        self.real, self.crash_at, self.calls = real, crash_at, 0

    def generate(self, requests, progress=lambda n: None):
        self.calls += 1
        if self.calls == self.crash_at:
            raise KeyboardInterrupt
        return self.real.generate(requests, progress)


def test_the_settings_are_on_disk_before_the_first_shard_and_every_rerun_checks_them(
    tiny_target_dir, tiny_data, tmp_path
):
    """A run killed early, then rerun with another temperature or target, would mix two settings in
    one directory: refused in one line naming the setting (and, for the target, before loading it)."""
    data = source(tmp_path, prompts_from(tiny_data, 40))
    out = tmp_path / "o"
    cfg = config(tiny_target_dir, data, out, temperature=0.7, rows_per_shard=8, max_new_tokens=4, batch_size=8)
    real = HFBackend.load(tiny_target_dir, cfg.sampling(), 8)
    with pytest.raises(KeyboardInterrupt):  # rows go in waves of 32: killed as the second starts
        regenerate(cfg, Crashing(real, 2), log=lambda m: None, progress_bar=False)
    before = len(out_rows(out))
    assert before > 0  # (an empty sampled answer is an error row)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sampling"]["temperature"] == 0.7 and manifest["sources"] == [str(data)]
    with pytest.raises(SpecdraftError) as err:
        regenerate(config(tiny_target_dir, data, out, temperature=0.5), real, log=lambda m: None)
    assert str(err.value) == (
        f"{out}: holds rows regenerated with other temperature: 0.7 there, 0.5 asked; "
        f"rerun with the same settings or use a new --out directory"
    )
    other = tmp_path / "other-target"
    shutil.copytree(tiny_target_dir, other)
    config_json = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config_json, "rms_norm_eps": 1e-5}))
    with pytest.raises(SpecdraftError, match=r"with other target: '[0-9a-f]{16}' there, '[0-9a-f]{16}' asked"):
        regenerate(config(other, data, out, temperature=0.7), log=lambda m: None)
    with pytest.raises(SpecdraftError, match="holds rows regenerated with other --data files"):
        (tmp_path / "elsewhere").mkdir()
        regenerate(
            config(tiny_target_dir, source(tmp_path / "elsewhere", ROWS), out, temperature=0.7),
            real,
            log=lambda m: None,
        )
    done = regenerate(cfg, real, log=lambda m: None, progress_bar=False)  # the same settings resume
    assert done["skipped_done"] == before and done["rows"] + done["errors"] == 40 - before


def test_each_row_gets_its_own_budget_whatever_its_batch(tiny_target_dir, tiny_data):
    """Budgets differ (max_length minus the prompt): in a batch with larger budgets a row still
    stops at its own and its answer is the one it gets alone (greedy). The tiny target is made to
    stop at token 'P' (its 4th greedy token) so answers end inside the batch's largest budget."""
    from specdraft.regenerate.backends import Request, Sampling, prompt_ids

    prompts = [r["prompt"] for r in prompts_from(tiny_data, 8)]
    requests = [Request([{"role": "user", "content": p}], 0, str(i)) for i, p in enumerate(prompts)]
    loaded = HFBackend.load(tiny_target_dir, Sampling(), 1)
    loaded.model.generation_config.eos_token_id = [1, 4, loaded.tokenizer.convert_tokens_to_ids("P")]
    lengths = [len(prompt_ids(loaded.tokenizer, r, Sampling())[0]) for r in requests]
    sampling = Sampling(max_new_tokens=12, max_length=max(lengths) + 2)
    budgets = [min(12, sampling.max_length - n) for n in lengths]
    assert min(budgets) == 2 and max(budgets) == 12

    def answers(batch_size):
        backend = HFBackend(loaded.model, loaded.tokenizer, sampling, batch_size)
        return [(a.token_ids, a.finish) for a in backend.generate(requests)]

    alone, batched = answers(1), answers(8)
    assert batched == alone
    assert all(len(ids) <= b for (ids, _), b in zip(batched, budgets))
    short = [k for k, b in enumerate(budgets) if b == 2]
    assert [batched[k] for k in short] == [(alone[k][0][:2], "length") for k in short]
    assert any(finish == "stop" and len(ids) > 2 for ids, finish in batched)  # a stop the short rows must not reach


def alternating_template_target(tiny_target_dir, tmp_path):
    """The tiny target with a template that raises on roles out of order (as Llama-2's and
    Mistral's do)."""
    target = tmp_path / "strict-target"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return target


def test_rows_the_template_refuses_are_skipped_with_the_reason_and_the_rest_finish(tiny_target_dir, tmp_path, capsys):
    """A row the template cannot render is the row's problem: it goes to errors.jsonl as "skipped"
    with the reason, every other row is written, and the command exits 0 (a rerun would skip it again;
    only rows the servers failed make it fail)."""
    from specdraft import cli

    target = alternating_template_target(tiny_target_dir, tmp_path)
    data = source(
        tmp_path,
        [
            {
                "id": "gpt-first",
                "conversations": [
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "x"},
                ],
            },
            {
                "id": "two-users",
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "x"},
                ],
            },
            {"id": "fine", "prompt": "def add(a, b):"},
            {"id": "bad-shape", "messages": [{"role": "user", "content": 3}]},
        ],
    )
    out = tmp_path / "o"
    code = cli.main(
        ["regenerate", "--target", str(target), "--data", str(data), "--out", str(out), "--max-new-tokens", "4"]
    )
    assert code == 0 and [r["id"] for r in out_rows(out)] == ["fine"]
    lines = (out / "errors.jsonl").read_text().splitlines()
    errors = {e["source"].rsplit(":", 1)[1]: e for e in map(json.loads, lines)}  # by line number
    assert {k: e["kind"] for k, e in errors.items()} == {"1": "skipped", "2": "skipped", "4": "skipped"}
    assert errors["1"]["reason"] == "turn 0: no prompt: the row starts with an assistant turn"
    assert errors["2"]["reason"] == (
        "turn 0: the chat template cannot render this conversation: "
        "Conversation roles must alternate user/assistant/user/assistant/..."
    )
    assert errors["4"]["reason"] == "turn 0 has no text 'content'"
    assert "; 3 rows skipped (" in capsys.readouterr().out
    only_bad = source(
        tmp_path / "bad",
        [{"id": "two-users", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}],
    )
    assert (
        cli.main(
            [
                "regenerate",
                "--target",
                str(target),
                "--data",
                str(only_bad),
                "--out",
                str(tmp_path / "none"),
                "--max-new-tokens",
                "4",
            ]
        )
        == 1
    )  # no row at all: `regenerate && train` stops
    assert capsys.readouterr().out.rstrip().endswith(f"; NO rows in {tmp_path / 'none'}")


def test_rows_are_keyed_by_file_and_id_and_duplicate_ids_in_a_file_are_reported(tiny_target_dir, tmp_path):
    class Echo:  # answers at once: the keys are what is tested
        name = "hf"

        def generate(self, requests, progress=lambda n: None):
            from specdraft.regenerate.backends import Answer

            return [Answer(text="re: " + r.messages[-1]["content"], tokens=1) for r in requests]

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        "".join(json.dumps({"id": i, "prompt": f"a{i}"}) + "\n" for i in range(3))
        + json.dumps({"id": 1, "prompt": "a1 again"})
        + "\n"
    )
    b.write_text("".join(json.dumps({"id": i, "prompt": f"b{i}"}) + "\n" for i in range(3)))
    cfg = RegenerateConfig(target=str(tiny_target_dir), data=[str(a), str(b)], out=str(tmp_path / "o"))
    first = regenerate(cfg, Echo(), log=lambda m: None, progress_bar=False)
    answers = sorted(r["conversations"][-1]["content"] for r in out_rows(tmp_path / "o"))
    assert answers == ["re: a0", "re: a1", "re: a2", "re: b0", "re: b1", "re: b2"] and first["rows"] == 6
    (dup,) = [json.loads(line) for line in (tmp_path / "o" / "errors.jsonl").read_text().splitlines()]
    assert dup == {
        "id": "1",
        "sample": None,
        "source": f"{a}:4",
        "kind": "skipped",
        "reason": f"duplicate id '1': {a}:2 has it (the first is kept)",
    }
    again = regenerate(cfg, Echo(), log=lambda m: None, progress_bar=False)
    assert again["rows"] == 0 and again["skipped_done"] == 6 and again["skipped"] == 1


def test_a_truncated_answer_is_kept_without_a_trained_end_of_turn(tiny_target_dir, tokenizer, tiny_data, tmp_path):
    data = source(tmp_path, prompts_from(tiny_data, 2))
    summary = regenerate(
        config(tiny_target_dir, data, tmp_path / "o", max_new_tokens=3), log=lambda m: None, progress_bar=False
    )
    rows = out_rows(tmp_path / "o")
    answers = [r["conversations"][-1] for r in rows]
    assert all(a["truncated"] is True and len(a["token_ids"]) == 3 for a in answers) and summary["truncated"] == 2
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["counts"]["truncated_answers"] == 2
    for where, messages in iter_conversations([str(p) for p in sorted((tmp_path / "o").glob("shard-*"))]):
        ids, mask = tokenize_conversation(tokenizer, messages, where)
        assert [t for t, k in zip(ids, mask) if k] == messages[-1]["token_ids"]  # no <|im_end|> after it


class Echo:
    """Answers at once ("re: <prompt>"), under the given backend name; `on_call(n)` runs at its n-th call."""

    def __init__(self, name="hf", on_call=lambda n: None):
        self.name, self.on_call, self.calls = name, on_call, 0

    def generate(self, requests, progress=lambda n: None):
        from specdraft.regenerate.backends import Answer

        self.calls += 1
        self.on_call(self.calls)
        return [Answer(text="re: " + r.messages[-1]["content"], tokens=1) for r in requests]


def files_of(out):
    return {p.name: p.read_bytes() for p in sorted(Path(out).iterdir())}


@pytest.mark.parametrize("first, then", [("hf", "openai"), ("openai", "hf")])
def test_a_rerun_with_another_backend_is_refused_before_a_model_or_server_is_touched(
    first, then, tiny_target_dir, tiny_data, tmp_path, monkeypatch, capsys
):
    """hf rows carry the ids the target generated, openai rows what a server gave: one --out holds
    one backend's rows. The refusal names the key, comes before any model is loaded or server
    asked, and leaves every file as it was."""
    from specdraft import cli
    from specdraft.regenerate import run as module

    data = source(tmp_path, prompts_from(tiny_data, 3))
    out = tmp_path / "o"
    regenerate(
        config(tiny_target_dir, data, out, backend=first, servers=["http://127.0.0.1:9"]),
        Echo(first),
        log=lambda m: None,
        progress_bar=False,
    )
    assert json.loads((out / "manifest.json").read_text())["backend"] == first and out_rows(out)
    before = files_of(out)

    def no_backend(cfg):
        raise AssertionError("a backend was built: a model loaded or a server asked")

    monkeypatch.setattr(module, "_build_backend", no_backend)
    capsys.readouterr()
    code = cli.main(
        [
            "regenerate",
            "--target",
            str(tiny_target_dir),
            "--data",
            str(data),
            "--out",
            str(out),
            "--max-new-tokens",
            "16",
            "--backend",
            then,
            "--servers",
            "http://127.0.0.1:9",
        ]
    )
    assert code == 2
    assert capsys.readouterr().err == (
        f"specdraft: error: {out}: holds rows regenerated with other backend: "
        f"{first!r} there, {then!r} asked; rerun with the same settings or use a "
        f"new --out directory\n"
    )
    assert files_of(out) == before


def test_sigterm_keeps_the_finished_rows_counts_them_and_exits_143(tiny_target_dir, tiny_data, tmp_path, capsys):
    """SIGTERM (what SLURM and Kubernetes send) in the third generate call: the 8 rows the first two
    finished are written though no shard was full, the manifest counts them, one line says so, the
    exit code is 128 + 15, and the caller's handler is back. The rerun does the other rows only."""
    data = source(tmp_path, prompts_from(tiny_data, 12))
    out = tmp_path / "o"
    # a wave is 4 rows (batch_size and concurrency 1): one generate call finishes 4 one-turn rows
    cfg = config(tiny_target_dir, data, out, batch_size=1, concurrency=1, rows_per_shard=1000)

    class Stopped(Exception):
        pass

    def callers_handler(signum, frame):  # the handler regenerate must put back (and, before the fix,
        raise Stopped()  # what ran instead of it: nothing written)

    def kill(n):
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the signal lands in here

    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            regenerate(cfg, Echo(on_call=kill), progress_bar=False)
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = out_rows(out)
    assert stopped.value.code == 143 and len(rows) == 8
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"regenerate: interrupted by SIGTERM: 8 rows on disk in {out} (8 written by this run); "
        f"rerun the same command to resume"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rows_written"] == 8 and manifest["interrupted"] == "SIGTERM"
    again = regenerate(cfg, Echo(), log=lambda m: None, progress_bar=False)
    keys = [(r["id"], r["sample"]) for r in out_rows(out)]
    assert again["rows"] == 4 and again["skipped_done"] == 8 and len(keys) == len(set(keys)) == 12


def bar_answers(path: Path, total: int) -> int:
    """The answers the progress bar (tqdm, on stderr) has counted so far (a row of one turn: one)."""
    import re

    found = re.findall(rf"(\d+)/{total} answers \[", path.read_text(errors="replace")) if path.exists() else []
    return max(map(int, found), default=0)


def test_ctrl_c_writes_the_finished_rows_and_the_same_command_resumes_after_them(tiny_target_dir, tiny_data, tmp_path):
    """Ctrl-C once a wave of rows has finished, none of them in a shard yet (--rows-per-shard 1000):
    they are written, counted in manifest.json, one line says so, exit 130; the rerun writes every
    other row once."""
    total = 24
    data = source(tmp_path, prompts_from(tiny_data, total))
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-m",
        "specdraft",
        "regenerate",
        "--target",
        str(tiny_target_dir),
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-new-tokens",
        "8",
        "--batch-size",
        "1",
        "--concurrency",
        "1",
        "--rows-per-shard",
        "1000",
    ]
    stderr = tmp_path / "stderr.txt"
    # rows finish 4 at a time (a wave, one generate call); the pause after each call keeps the run
    # going. The bar counts answers as they land: its 5th is in the second call, so the first
    # call's 4 rows are finished (a signal inside a call loses that call's answers, by design)
    env = {**os.environ, "SPECDRAFT_REGENERATE_PAUSE_S": "0.5"}
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and bar_answers(stderr, total) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it was interrupted"
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    rows = out_rows(out)
    assert proc.returncode == 130, stderr.read_text()[-2000:]
    assert len(rows) >= 4 and not list(out.glob("*.tmp"))
    assert stdout.splitlines()[-1] == (
        f"regenerate: interrupted by SIGINT: {len(rows)} rows on disk in {out} "
        f"({len(rows)} written by this run); rerun the same command to resume"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rows_written"] == len(rows) and manifest["interrupted"] == "SIGINT"
    kept = files_of(out)
    done = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    keys = [(r["id"], r["sample"]) for r in out_rows(out)]
    errors = len((out / "errors.jsonl").read_text().splitlines())
    assert len(keys) == len(set(keys)) and len(keys) + errors == total
    after = files_of(out)  # the kept rows' shards, untouched
    assert all(after[name] == content for name, content in kept.items() if name.startswith("shard-"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rows_written"] == len(keys) and "interrupted" not in manifest


def test_rank_0_waits_for_this_launch_s_ranks_never_for_files_an_earlier_launch_left(tmp_path):
    """The ranks meet through files in --out. An earlier launch killed before rank 0 read them left
    a finished rank 1 and rank 0's answer: neither passes for this launch's, whichever rank comes
    first, and rank 0 gets this launch's counts."""
    import threading

    from specdraft.regenerate.ranks import RankSync, Stop

    def launch(first):
        out = tmp_path / first
        out.mkdir()
        (out / "manifest.json").write_text("{}")
        zero, one = RankSync(out, 0, 2, Stop()), RankSync(out, 1, 2, Stop())
        one.path(1).write_text(json.dumps({"nonce": "old", "run": "old-run", "errors": 7}))
        zero.path(0).write_text(json.dumps({"run": "old-run", "nonces": {"1": "old"}}))
        gathered = {}
        threads = {
            "zero": threading.Thread(target=lambda: gathered.update(zero.gather())),
            "one": threading.Thread(target=lambda: one.finish({"errors": 2})),
        }
        threads[first].start()
        threads[first].join(timeout=1.0)
        assert threads[first].is_alive()  # it waits for the other rank of this launch
        second = "one" if first == "zero" else "zero"
        threads[second].start()
        for thread in threads.values():
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in threads.values())
        assert list(gathered) == [1] and gathered[1]["errors"] == 2 and gathered[1]["run"] == zero.token

    launch("zero")
    launch("one")


def test_the_progress_bar_counts_answers_as_each_batch_lands(tiny_target_dir, tmp_path, monkeypatch):
    """Single- and multi-turn rows in one wave: the bar moves per answer as each batch of 2 comes
    back (not once per wave of 4 batches, or per finished row), totals every answer asked for, and
    shows no time left before the first answer lands."""
    from specdraft.regenerate import run as module
    from specdraft.regenerate.backends import Answer

    seen = []

    class Batches:  # 2 answers per batch, as HFBackend calls progress: once per answer
        name = "hf"

        def generate(self, requests, progress=lambda n: None):
            out = []
            for b in range(0, len(requests), 2):
                seen.append(("batch", bars[0].n))
                for r in requests[b : b + 2]:
                    fail = r.messages[-1]["content"] == "fail"
                    out.append(Answer(error="boom", server_error=True) if fail else Answer(text="ok", tokens=3))
                    progress(0 if fail else 3)
            return out

    bars = []
    real = module._progress
    monkeypatch.setattr(module, "_progress", lambda total, enabled: bars.append(real(total, True)) or bars[-1])
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    rows = [
        {"id": 0, "messages": [user("a")]},
        {"id": 1, "messages": [user("b"), {"role": "assistant", "content": "old"}, user("c")]},  # 2 answers
        {"id": 2, "messages": [user("fail"), {"role": "assistant", "content": "x"}, user("d")]},  # fails at once
        {"id": 3, "messages": [user("e")]},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RegenerateConfig(target=str(tiny_target_dir), data=[str(data)], out=str(tmp_path / "o"), batch_size=2)
    assert "<?" in str(real(6, True))  # before any answer: no time left is guessed
    summary = regenerate(cfg, Batches(), log=lambda m: None)
    bar = bars[0]
    assert bar.total == 6 and bar.n == 6 and summary["rows"] == 3 and summary["failed"] == 1
    # turn 0: 4 prompts in 2 batches, the bar at 0 then 2; turn 1: row 1's second answer, the bar
    # settled at 5 (3 answers + row 2's 2 that will not be asked)
    assert seen == [("batch", 0), ("batch", 2), ("batch", 5)]
