"""`specdraft regenerate`: both backends, resume, kill trials, and output that training reads."""

import json
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
from specdraft.data.generation import HFBackend
from specdraft.data.sources import iter_conversations
from specdraft.errors import SpecdraftError
from specdraft.regenerate import RegenerateConfig, regenerate, written_keys
from specdraft.run import MARKER, REGENERATE, marker_text

ROWS = [
    {"prompt": "def add(a, b):"},
    {"id": "multi", "conversations": [
        {"role": "system", "content": "Write Python."},
        {"role": "user", "content": "def square(x):"},
        {"role": "assistant", "content": "a human answer"},
        {"role": "user", "content": "def cube(x):"},
        {"role": "assistant", "content": "another human answer"}]},
    {"messages": [{"role": "user", "content": "def mean(values):"}]},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def source(tmp_path, rows):
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
    return RegenerateConfig(target=str(target), data=[str(data)], out=str(out), max_new_tokens=16, **kw)


def test_hf_regenerates_every_turn_on_its_own_answers_and_training_uses_its_ids(tiny_target_dir, tokenizer, tmp_path):
    data = source(tmp_path, ROWS)
    summary = regenerate(config(tiny_target_dir, data, tmp_path / "a", temperature=0.7, samples=2),
                         log=lambda m: None, progress_bar=False)
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
    regenerate(config(tiny_target_dir, data, tmp_path / "b", temperature=0.7, samples=2, batch_size=1),
               log=lambda m: None, progress_bar=False)
    key = lambda r: (r["id"], r["sample"])
    assert sorted(rows, key=key) == sorted(out_rows(tmp_path / "b"), key=key)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["sampling"]["temperature"] == 0.7 and manifest["counts"]["rows_written"] == len(rows)
    assert manifest["sources"] == [str(data)] and manifest["token_ids"] == "generated ids"
    # training reads the shards directly, and the masked tokens are exactly the generated ids
    for where, messages in iter_conversations([str(p) for p in sorted((tmp_path / "a").glob("shard-*"))]):
        ids, mask = tokenize_conversation(tokenizer, messages, where)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        expected = [t for m in messages if m["role"] == "assistant" for t in own_ids(tokenizer, m) + [im_end]]
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
                    a.error = "server error after 5 attempts: HTTP 503"
            return answers

    first = regenerate(cfg, Flaky(), log=lambda m: None, progress_bar=False)
    errors = [json.loads(l) for l in (tmp_path / "o" / "errors.jsonl").read_text().splitlines()]
    assert first["errors"] == 2 and all("HTTP 503" in e["reason"] and e["source"] for e in errors)
    second = regenerate(cfg, real, log=lambda m: None, progress_bar=False)
    assert second["rows"] == 2 and second["skipped_done"] == 4 and second["errors"] == 0
    third = regenerate(cfg, real, log=lambda m: None, progress_bar=False)
    assert third["rows"] == 0 and third["skipped_done"] == 6
    assert len({(r["id"], r["sample"]) for r in out_rows(tmp_path / "o")}) == len(out_rows(tmp_path / "o")) == 6
    with pytest.raises(SpecdraftError, match="other sampling"):
        regenerate(config(tiny_target_dir, data, tmp_path / "o", temperature=0.5), real, log=lambda m: None)


def test_a_rerun_removes_the_temp_shard_a_killed_run_left_and_only_its_own_ranks(tiny_target_dir, tiny_data,
                                                                                  tmp_path):
    """A SIGKILL between a shard's temp write and its rename leaves `<shard>.jsonl.tmp` (never a
    shard); the rerun of that rank removes it. Another rank's temp file may be its live write."""
    data = source(tmp_path, prompts_from(tiny_data, 2))
    out = tmp_path / "o"
    out.mkdir()
    (out / MARKER).write_text(marker_text(REGENERATE))  # what the killed run wrote first
    ours = out / "shard-r000-20260101000000-abcdef-00003.jsonl.tmp"
    theirs = out / "shard-r001-20260101000000-fedcba-00000.jsonl.tmp"
    for stale in (ours, theirs):
        stale.write_text('{"id": "half a row')
    cfg = config(tiny_target_dir, data, out)
    summary = regenerate(cfg, HFBackend.load(tiny_target_dir, cfg.sampling(), 4), log=lambda m: None,
                         progress_bar=False)
    assert summary["rows"] == 2 and not ours.exists() and theirs.exists()


def test_ranks_share_the_rows_and_write_what_one_process_writes(tiny_target_dir, tiny_data, tmp_path, monkeypatch):
    """Under torchrun each rank (RANK / WORLD_SIZE) takes the rows its id hashes to: two ranks into
    one directory write every row exactly once, the same answers one process writes (seeds come
    from the row, not from the process)."""
    data = source(tmp_path, prompts_from(tiny_data, 12))
    single = tmp_path / "single"
    regenerate(config(tiny_target_dir, data, single, temperature=0.7), progress_bar=False)
    shared = tmp_path / "shared"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        regenerate(config(tiny_target_dir, data, shared, temperature=0.7), progress_bar=False)
    rows = out_rows(shared)
    import hashlib

    for rank in (0, 1):  # each rank wrote exactly the rows whose id hashes to it
        own = [json.loads(line) for p in shared.glob(f"shard-r{rank:03d}-*.jsonl") for line in p.read_text().splitlines()]
        assert own and all(int(hashlib.sha256(f"{r['id']}#{r['sample']}".encode()).hexdigest(), 16) % 2 == rank
                           for r in own)
    keys = [(r["id"], r["sample"]) for r in rows]
    single_rows = out_rows(single)
    assert len(keys) == len(set(keys)) == len(single_rows) >= 10  # an empty sampled answer is an error row
    answers = lambda rs: {(r["id"], r["sample"]): r["conversations"][-1]["content"] for r in rs}  # noqa: E731
    assert answers(rows) == answers(single_rows)


def test_too_long_rows_go_to_the_errors_file(tiny_target_dir, tmp_path):
    data = source(tmp_path, [{"prompt": "x " * 200}, {"prompt": "def f():"}])
    summary = regenerate(config(tiny_target_dir, data, tmp_path / "o", max_length=64), log=lambda m: None,
                         progress_bar=False)
    (error,) = [json.loads(l) for l in (tmp_path / "o" / "errors.jsonl").read_text().splitlines()]
    assert summary["errors"] == 1 and "too long" in error["reason"] and error["source"].endswith("in.jsonl:1")


def test_sigkill_at_random_moments_then_rerun_writes_every_row_exactly_once(tiny_target_dir, tiny_data, tmp_path):
    data = source(tmp_path, prompts_from(tiny_data, 40))
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "specdraft", "regenerate", "--target", str(tiny_target_dir), "--data", str(data),
           "--out", str(out), "--max-new-tokens", "24", "--batch-size", "1", "--concurrency", "1", "--rows-per-shard", "2",
           "--temperature", "0.7"]
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
    proc = subprocess.Popen([str(serve), "serve", str(tiny_target_dir), "--port", str(port), "--device", "cpu",
                             "--host", "127.0.0.1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    data = source(tmp_path, prompts_from(tiny_data, 6))
    dead = "http://127.0.0.1:9"  # a second server that refuses: its requests are retried on the live one
    cfg = config(tiny_target_dir, data, tmp_path / "s", backend="openai", servers=[served_target, dead],
                 concurrency=2)
    from specdraft.data.openai_backend import OpenAIBackend

    backend = OpenAIBackend(cfg.servers, AutoTokenizer.from_pretrained(tiny_target_dir), cfg.sampling(),
                            concurrency=2, backoff_s=0.05)
    summary = regenerate(cfg, backend, log=lambda m: None, progress_bar=False)
    served = {r["id"]: r["conversations"][-1]["content"] for r in out_rows(tmp_path / "s")}
    assert summary["rows"] + summary["errors"] == 6 and summary["rows"] >= 4 and summary["tokens"] > 0
    # greedy: the server's answers are the hf backend's
    regenerate(config(tiny_target_dir, data, tmp_path / "h"), log=lambda m: None, progress_bar=False)
    local = {r["id"]: r["conversations"][-1]["content"] for r in out_rows(tmp_path / "h")}
    assert served == {k: v for k, v in local.items() if k in served}
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["backend"] == "openai"
