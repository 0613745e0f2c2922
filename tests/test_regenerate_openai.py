"""`specdraft regenerate --backend openai` against a local stub server (http.server in a thread) that
records every request body and answers, per prompt, as a script says: what is sent, which failures
are row errors, which are retried, the servers' check before the first row, and the exit code."""

import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from specdraft import cli
from specdraft.regenerate import openai_backend
from specdraft.regenerate.backends import Request, Sampling
from specdraft.regenerate.openai_backend import OpenAIBackend
from specdraft.regenerate.run import RegenerateConfig, _build_backend, regenerate
from specdraft.regenerate.rows import row_seed


class Stub:
    """An OpenAI-compatible server. `script[prompt]`: the replies to that prompt's requests in turn
    (the last one repeats): "ok", "long" (finish_reason length), "empty" (no choices), "incomplete"
    (a body cut short), "reset" (the connection reset), ("http", code, detail), ("refuse", field)
    (422 naming the field while it is sent, as `transformers serve` does), ("hold", event) ("ok" once
    the event is set: a long generation)."""

    def __init__(self):
        self.bodies, self.script, self.seen, self.models_status = [], {}, {}, 200
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path != "/v1/models" or stub.models_status != 200:
                    return self.reply(stub.models_status if stub.models_status != 200 else 404, {"error": "no"})
                self.reply(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with stub.lock:
                    stub.bodies.append(body)
                    n = stub.seen[prompt] = stub.seen.get(prompt, -1) + 1
                    replies = stub.script.get(prompt, ["ok"])
                    what = replies[min(n, len(replies) - 1)]
                if isinstance(what, tuple) and what[0] == "hold":
                    what[1].wait(60)
                    what = "ok"
                if what in ("ok", "long") or (isinstance(what, tuple) and what[0] == "refuse" and what[1] not in body):
                    return self.reply(
                        200,
                        {
                            "choices": [
                                {
                                    "index": 0,
                                    "message": {"role": "assistant", "content": f"re: {prompt}"},
                                    "finish_reason": "length" if what == "long" else "stop",
                                }
                            ],
                            "usage": {"completion_tokens": 3},
                        },
                    )
                if what == "empty":
                    return self.reply(200, {"choices": [], "usage": {"completion_tokens": 0}})
                if what == "incomplete":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'{"choices": [')
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if what == "reset":  # RST instead of a reply
                    self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.request.close()
                    self.close_connection = True
                    return
                if what[0] == "http":
                    return self.reply(what[1], {"error": {"message": what[2]}})
                self.reply(422, {"detail": f"Unexpected fields in the request: {{'{what[1]}'}}"})

            def reply(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def finish(self):
                try:
                    super().finish()
                except OSError:
                    pass  # the "reset" reply closed the socket itself

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def asked(self, prompt):
        return [b for b in self.bodies if b["messages"][-1]["content"] == prompt]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def prompts_file(tmp_path, prompts, name="in.jsonl"):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": p, "prompt": p}) + "\n" for p in prompts))
    return path


def run(stub, tiny_target_dir, tokenizer, tmp_path, prompts, retries=4, **kw):
    """regenerate through the stub with fast retries; (summary, rows by id, error rows by id)."""
    cfg = RegenerateConfig(
        target=str(tiny_target_dir),
        data=[str(prompts_file(tmp_path, prompts))],
        out=str(tmp_path / "out"),
        backend="openai",
        servers=[stub.url],
        max_new_tokens=16,
        concurrency=2,
        **kw,
    )
    backend = OpenAIBackend(cfg.servers, tokenizer, cfg.sampling(), concurrency=2, retries=retries, backoff_s=0.001)
    summary = regenerate(cfg, backend, log=lambda m: None, progress_bar=False)
    out = Path(cfg.out)
    rows = {
        json.loads(line)["id"]: json.loads(line)
        for p in out.glob("shard-*.jsonl")
        for line in p.read_text().splitlines()
    }
    errors = {json.loads(line)["id"]: json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()}
    return summary, rows, errors


def test_every_sampling_parameter_is_sent_explicitly(stub, tiny_target_dir, tokenizer, tmp_path):
    """top_p 1 and top_k off are sent too: a server left to fill them in takes the model's
    generation_config.json (Qwen3: top_p 0.95, top_k 20) while the manifest says 1.0."""
    summary, rows, _ = run(
        stub, tiny_target_dir, tokenizer, tmp_path, ["def f():"], temperature=0.7, seed=3, max_length=4096
    )
    (body,) = stub.bodies
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def f():"}], tokenize=False, add_generation_prompt=True
    )
    assert len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + 16 < 4096  # the budget is max_new_tokens
    assert {
        k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed")
    } == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 16,
        "seed": row_seed(3, "def f():", 0, 0),
    }
    assert summary["rows"] == 1 and rows["def f():"]["conversations"][-1]["content"] == "re: def f():"


def test_transport_errors_are_row_errors_and_the_other_rows_finish(stub, tiny_target_dir, tokenizer, tmp_path):
    stub.script = {
        "cut": ["incomplete"],
        "none": ["empty"],
        "rst": ["reset"],
        "flaky": ["incomplete", "reset", "empty", "ok"],
    }  # three failures, then an answer
    summary, rows, errors = run(
        stub, tiny_target_dir, tokenizer, tmp_path, ["ok", "cut", "none", "rst", "flaky"], retries=3
    )
    assert set(rows) == {"ok", "flaky"} and summary["failed"] == 3 and summary["skipped"] == 0
    assert all(e["kind"] == "failed" and "after 4 attempts" in e["reason"] for e in errors.values())
    assert "IncompleteRead" in errors["cut"]["reason"]
    assert "no choice" in errors["none"]["reason"]
    assert "Connection" in errors["rst"]["reason"] or "Remote" in errors["rst"]["reason"]
    assert len(stub.asked("flaky")) == 4 and len(stub.asked("cut")) == 4


def test_4xx_is_not_retried_but_408_429_and_5xx_are(stub, tiny_target_dir, tokenizer, tmp_path):
    stub.script = {
        "long prompt": [("http", 400, "maximum context length is 8 tokens")],
        "missing": [("http", 404, "no such model")],
        "busy": [("http", 429, "slow down"), ("http", 408, "timeout"), ("http", 503, "loading"), "ok"],
    }
    summary, rows, errors = run(stub, tiny_target_dir, tokenizer, tmp_path, ["long prompt", "missing", "busy"])
    assert len(stub.asked("long prompt")) == 1 and len(stub.asked("missing")) == 1
    assert len(stub.asked("busy")) == 4 and set(rows) == {"busy"}
    assert "HTTP 400" in errors["long prompt"]["reason"] and "maximum context length" in errors["long prompt"]["reason"]
    assert summary["failed"] == 2


def test_backoff_has_jitter(stub, tiny_target_dir, tokenizer, tmp_path, monkeypatch):
    """Clients that failed together must not retry together: each delay is drawn in
    [0, backoff * 2**attempt], so two rows' delays differ (and are not the fixed schedule)."""
    sleeps = []
    monkeypatch.setattr(openai_backend, "time", SimpleNamespace(sleep=sleeps.append))
    stub.script = {"a": [("http", 503, "busy")], "b": [("http", 503, "busy")]}
    backend = OpenAIBackend([stub.url], tokenizer, Sampling(max_new_tokens=4), concurrency=1, retries=3, backoff_s=0.5)
    answers = backend.generate([Request([{"role": "user", "content": p}], 0, p) for p in "ab"])
    assert all(a.error and a.server_error for a in answers)
    assert len(sleeps) == 6  # three waits per row, none after the last attempt
    first, second = sleeps[:3], sleeps[3:]
    assert all(0 <= s <= 0.5 * 2**k for k, s in enumerate(first)) and all(
        0 <= s <= 0.5 * 2**k for k, s in enumerate(second)
    )
    assert first != second and first != [0.5, 1.0, 2.0]


def test_timeout_is_an_option(tiny_target_dir, tmp_path):
    args = cli.build_parser().parse_args(
        ["regenerate", "--target", "t", "--data", "d", "--out", "o", "--timeout", "7.5"]
    )
    assert args.timeout == 7.5
    cfg = RegenerateConfig(
        target=str(tiny_target_dir), data=["x"], out="o", backend="openai", servers=["http://127.0.0.1:1"], timeout=7.5
    )
    assert _build_backend(cfg).timeout_s == 7.5
    config = tmp_path / "r.yaml"
    config.write_text("timeout: 0\n")
    assert cli.main(["regenerate", "--config", str(config), "--target", "t", "--data", "d", "--out", "o"]) == 2


def test_a_refused_top_k_is_dropped_when_greedy_and_fails_the_row_when_sampling(
    stub, tiny_target_dir, tokenizer, tmp_path
):
    """`transformers serve` answers 422 to fields it does not know. Greedy ignores top_k, so the
    request goes on without it (the manifest says so); sampling without it would use the server's
    own top_k, so the row fails naming the field."""
    stub.script = {p: [("refuse", "top_k")] for p in ("x", "y")}
    summary, rows, _ = run(stub, tiny_target_dir, tokenizer, tmp_path / "greedy", ["x"])
    assert set(rows) == {"x"} and [("top_k" in b) for b in stub.bodies] == [True, False]
    manifest = json.loads((tmp_path / "greedy" / "out" / "manifest.json").read_text())
    assert manifest["server_refused_fields"] == {stub.url + "/v1/chat/completions": ["top_k"]}
    summary, rows, errors = run(stub, tiny_target_dir, tokenizer, tmp_path / "sampled", ["y"], temperature=0.7)
    assert not rows and summary["failed"] == 1 and "refuses top_k" in errors["y"]["reason"]


def test_a_truncated_server_answer_is_marked_and_counted(stub, tiny_target_dir, tokenizer, tmp_path):
    stub.script = {"cut me": ["long"]}
    summary, rows, _ = run(stub, tiny_target_dir, tokenizer, tmp_path, ["cut me", "whole"])
    assert rows["cut me"]["conversations"][-1]["truncated"] is True
    assert "truncated" not in rows["whole"]["conversations"][-1] and summary["truncated"] == 1
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["truncated_answers"] == 1


def cli_regenerate(tiny_target_dir, tmp_path, *servers):
    data = prompts_file(tmp_path, ["p1", "p2"])
    return cli.main(
        [
            "regenerate",
            "--target",
            str(tiny_target_dir),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "out"),
            "--backend",
            "openai",
            "--servers",
            ",".join(servers),
            "--max-new-tokens",
            "8",
        ]
    )


def test_every_server_is_checked_before_the_first_row(stub, tiny_target_dir, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    assert cli_regenerate(tiny_target_dir, tmp_path, stub.url, dead) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"specdraft: error: --servers {dead}: no server answers GET {dead}/v1/models (")
    assert not stub.bodies and not list((tmp_path / "out").glob("shard-*"))
    stub.models_status = 404  # something answers, but not an OpenAI server
    assert cli_regenerate(tiny_target_dir, tmp_path, stub.url) == 2
    assert capsys.readouterr().err == (
        f"specdraft: error: --servers {stub.url}: not an OpenAI-compatible server: "
        f"GET {stub.url}/v1/models answered HTTP 404, and GET /health did not "
        f"answer 200\n"
    )


def test_failed_rows_make_the_command_fail_and_a_rerun_retries_them(
    stub, tiny_target_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(openai_backend, "time", SimpleNamespace(sleep=lambda s: None))
    stub.script = {"p2": [("http", 500, "boom")]}
    assert cli_regenerate(tiny_target_dir, tmp_path, stub.url) == 1  # `regenerate && train` stops here
    assert "1 rows FAILED (server errors: rerun the same command to retry them)" in capsys.readouterr().out
    stub.script = {}
    assert cli_regenerate(tiny_target_dir, tmp_path, stub.url) == 0
    rows = [json.loads(line) for p in (tmp_path / "out").glob("shard-*.jsonl") for line in p.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["p1", "p2"]


def test_a_server_that_dies_mid_run_has_its_requests_retried_on_the_others(stub, tiny_target_dir, tokenizer, tmp_path):
    other = Stub()
    backend = OpenAIBackend(
        [stub.url, other.url], tokenizer, Sampling(max_new_tokens=4), concurrency=1, backoff_s=0.001
    )
    backend.check()
    other.close()  # checked, then gone
    answers = backend.generate([Request([{"role": "user", "content": p}], 0, p) for p in ("a", "b", "c")])
    assert [a.text for a in answers] == ["re: a", "re: b", "re: c"] and len(stub.bodies) == 3


def test_a_stopped_generate_call_returns_at_once_and_sends_none_of_its_queued_requests(stub, tokenizer):
    """Ctrl-C in a generate call (here: raised as the first answer comes back) stops it at once,
    not after the requests in flight (a long generation: "p1" is held), and the queued ones are
    never sent: regenerate then writes its finished rows and exits."""
    released = threading.Event()
    stub.script = {"p1": [("hold", released)]}
    backend = OpenAIBackend([stub.url], tokenizer, Sampling(max_new_tokens=4), concurrency=1)

    def stop(tokens):
        raise KeyboardInterrupt

    timer = threading.Timer(10, released.set)  # were it waited for, the held reply would come then
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            backend.generate([Request([{"role": "user", "content": f"p{i}"}], 0, str(i)) for i in range(8)], stop)
        assert not released.is_set()
    finally:
        timer.cancel()
        released.set()
    assert {b["messages"][-1]["content"] for b in stub.bodies} <= {"p0", "p1"}
