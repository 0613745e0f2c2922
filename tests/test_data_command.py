"""`specdraft data`: golden `--json` output per vendor template, rows with nothing to learn skipped,
counted and named (data_strict refuses them), truncated rows counted, `--show` highlighting, and
only the tokenizer loaded."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chat_template_cases import TEMPLATES, template_target
from specdraft.config import load_config
from specdraft.data.packing import build_packed_cache, open_packed_cache, packed_cache_dir
from specdraft.commands.data_report import data_report

ROWS = [
    {
        "conversations": [
            {"role": "system", "content": "assistant"},
            {"role": "user", "content": "Say a letter."},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "user"},
            {"role": "assistant", "content": "  end \n"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nstart"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "<think>\nmore\n</think>\n\nassistant"},
        ]
    },
    {
        "conversations": [
            {"from": "gpt", "value": "hello"},
            {"from": "human", "value": "x"},
            {"from": "gpt", "value": "y"},
        ]
    },
    {"conversations": [{"from": "human", "value": "only a question"}]},
    {"conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]},
]

# Per template and row: the decoded text of each trained span (the answer as the template renders
# it, then its end-of-turn), or why the row is skipped. Read against each template's rules:
# trim (Llama-3.1, Gemma, Llama-2 strip), ' ' + content (Llama-2, Mistral: the space rides in the
# first token when the tokenizer merges it), history without reasoning (Qwen3: earlier turns; R1:
# every turn, newlines after </think> kept), assistant-first rows refused by alternating templates.
GOLDEN = {
    "qwen2_5": [
        ["a<|im_end|>", "  end \n<|im_end|>"],
        ["<think>\nwhy\n</think>\n\nstart<|im_end|>", "<think>\nmore\n</think>\n\nassistant<|im_end|>"],
        ["hello<|im_end|>", "y<|im_end|>"],
        "no assistant turn",
        "empty answer",
    ],
    "qwen3": [
        ["a<|im_end|>", "  end \n<|im_end|>"],
        ["start<|im_end|>", "<think>\nmore\n</think>\n\nassistant<|im_end|>"],
        ["hello<|im_end|>", "y<|im_end|>"],
        "no assistant turn",
        "empty answer",
    ],
    "phi4": [
        ["a<|im_end|>", "  end \n<|im_end|>"],
        ["<think>\nwhy\n</think>\n\nstart<|im_end|>", "<think>\nmore\n</think>\n\nassistant<|im_end|>"],
        ["hello<|im_end|>", "y<|im_end|>"],
        "no assistant turn",
        "empty answer",
    ],
    "llama3_1": [
        ["a<|eot_id|>", "end<|eot_id|>"],
        ["<think>\nwhy\n</think>\n\nstart<|eot_id|>", "<think>\nmore\n</think>\n\nassistant<|eot_id|>"],
        ["hello<|eot_id|>", "y<|eot_id|>"],
        "no assistant turn",
        "empty answer",
    ],
    "llama2": [
        [" a <|eos|>", "end <|eos|>"],
        ["<think>\nwhy\n</think>\n\nstart <|eos|>", "<think>\nmore\n</think>\n\nassistant <|eos|>"],
        "template refused",
        "no assistant turn",
        "empty answer",
    ],
    "mistral_v0_3": [
        [" a<|eos|>", "   end \n<|eos|>"],
        ["<think>\nwhy\n</think>\n\nstart<|eos|>", "<think>\nmore\n</think>\n\nassistant<|eos|>"],
        "template refused",
        "no assistant turn",
        "empty answer",
    ],
    "gemma3": [
        ["a<end_of_turn>", "end<end_of_turn>"],
        ["<think>\nwhy\n</think>\n\nstart<end_of_turn>", "<think>\nmore\n</think>\n\nassistant<end_of_turn>"],
        "template refused",
        "no assistant turn",
        "empty answer",
    ],
    "deepseek_r1": [
        ["a<｜end▁of▁sentence｜>", "  end \n<｜end▁of▁sentence｜>"],
        ["\n\nstart<｜end▁of▁sentence｜>", "\n\nassistant<｜end▁of▁sentence｜>"],
        ["hello<｜end▁of▁sentence｜>", "y<｜end▁of▁sentence｜>"],
        "no assistant turn",
        "empty answer",
    ],
}


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def config(target, data, tmp_path, *more):
    return load_config(
        None,
        [f"target={target}", f"data_files={data}", "max_seq_length=8", f"data_cache_dir={tmp_path / 'cache'}", *more],
    )


def report(cfg, **kwargs):
    out, logged = io.StringIO(), []
    data_report(cfg, out=out, log=logged.append, **kwargs)
    return out.getvalue(), logged


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_json_golden_each_span_is_the_rendered_answer_and_its_end_of_turn(tiny_target_dir, rows_file, tmp_path, name):
    target = template_target(tiny_target_dir, name, tmp_path / name)
    out, _ = report(config(target, rows_file, tmp_path), as_json=True)
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["source"] for r in rows] == [f"{rows_file}:{i}" for i in range(1, 6)]
    assert [r.get("skipped") or r["trained_text"] for r in rows] == GOLDEN[name]
    for r in rows:
        assert r["trained"] <= r["tokens"] and (r["trained"] > 0) == bool(r["trained_text"])


def test_summary_counts_rows_skipped_by_reason_tokens_trained_sequences_truncated(tiny_target_dir, rows_file, tmp_path):
    target = template_target(tiny_target_dir, "gemma3", tmp_path / "gemma3")
    cfg = config(target, rows_file, tmp_path)
    out, logged = report(cfg)
    cache_dir = packed_cache_dir([str(rows_file)], str(target), 8, None, tmp_path / "cache")
    meta = open_packed_cache(cache_dir).meta
    assert meta["conversations"] == 2 and meta["truncated"] == 2  # both kept rows are longer than 8 tokens
    # whole packing (the default): one window per conversation, each cut to 8 tokens, no padding
    cut = meta["tokens"] - 2 * 8
    lines = out.splitlines()
    assert lines[1:] == [
        "rows: 5",
        "skipped rows: 3",
        f"  template refused: 1 ({rows_file}:3)",
        f"  no assistant turn: 1 ({rows_file}:4)",
        f"  empty answer: 1 ({rows_file}:5)",
        f"tokens: {meta['tokens']}",
        f"trained tokens: {meta['assistant_tokens']} ({100 * meta['assistant_tokens'] / meta['tokens']:.1f}%)",
        f"packing whole: 2 windows of 8 tokens, {cut} tokens cut from conversations longer than a window, "
        "0 tokens of padding",
        "truncated rows: 2 (longer than max_seq_length=8)",
        f"skipped 3 of 5 rows: template refused ({rows_file}:3), no assistant turn ({rows_file}:4), "
        f"empty answer ({rows_file}:5)",
    ]
    # the stream packing, behind its key: the joined stream cut into windows
    stream = report(config(target, rows_file, tmp_path, "packing=stream"))[0].splitlines()
    assert stream[8] == f"packing stream: {meta['tokens'] // 8} windows of 8 tokens"
    assert stream[:8] + stream[9:] == lines[:8] + lines[9:]
    assert logged[-1] == f"data: {lines[-1]}"  # train's start-up summary says the same
    # the cache is the one train reads: same directory, tokens = the rows' own
    data = open_packed_cache(Path(lines[0].removeprefix("cache: ")))
    assert int(data.loss_mask.sum()) <= meta["assistant_tokens"]
    assert meta["assistant_tokens"] == sum(json.loads(x)["trained"] for x in report(cfg, as_json=True)[0].splitlines())


def test_skipped_rows_beyond_three_are_elided_in_the_summary(tiny_target_dir, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + (json.dumps(ROWS[3]) + "\n") * 5)
    out, logged = report(config(template_target(tiny_target_dir, "qwen2_5", tmp_path / "t"), path, tmp_path))
    assert logged[-1] == f"data: skipped 5 of 6 rows: no assistant turn ({path}:2, {path}:3, {path}:4, …)"
    assert f"  no assistant turn: 5 ({path}:2, {path}:3, {path}:4, …)" in out.splitlines()


def test_data_strict_refuses_the_first_row_with_nothing_to_learn(tiny_target_dir, rows_file, tmp_path):
    from specdraft.errors import SpecdraftError

    target = template_target(tiny_target_dir, "llama2", tmp_path / "t")
    with pytest.raises(
        SpecdraftError,
        match=rf"^{rows_file}:3: the chat template cannot render this conversation: "
        r"Conversation roles must alternate",
    ):
        report(config(target, rows_file, tmp_path, "data_strict=true"))
    report(config(target, rows_file, tmp_path))  # lenient: builds the cache, skipping three rows
    with pytest.raises(SpecdraftError, match=rf"^{rows_file}:3: the chat template cannot render"):
        report(config(target, rows_file, tmp_path, "data_strict=true"))  # a strict run refuses that cache too


def test_show_highlights_the_trained_tokens(tiny_target_dir, rows_file, tmp_path):
    target = template_target(tiny_target_dir, "llama3_1", tmp_path / "t")
    out, _ = report(config(target, rows_file, tmp_path), show=1)
    shown = out.split("\n== ", 1)[1]
    assert shown.startswith(f"{rows_file}:1: ")
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n[[a<|eot_id|>]]" in shown
    assert "[[end<|eot_id|>]]" in shown and shown.count("[[") == 2


def test_the_command_loads_only_the_tokenizer(tiny_target_dir, rows_file, tmp_path):
    target = template_target(tiny_target_dir, "qwen3", tmp_path / "t")  # config + tokenizer: no weights there
    assert not list(target.glob("*.safetensors"))
    (tmp_path / "c.yaml").write_text("max_seq_length: 8\n")
    code = (
        "import sys; from specdraft.cli import main; rc = main(sys.argv[1:]); "
        "assert 'deepspeed' not in sys.modules; sys.exit(rc)"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "data",
            "--json",
            str(tmp_path / "c.yaml"),
            f"target={target}",
            f"data_files={rows_file}",
            f"data_cache_dir={tmp_path / 'c'}",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(x).get("skipped") for x in done.stdout.splitlines()] == [
        None,
        None,
        None,
        "no assistant turn",
        "empty answer",
    ]


def test_the_command_refuses_in_one_line_with_data_strict(tiny_target_dir, rows_file, tmp_path, capsys):
    from specdraft.cli import main

    target = template_target(tiny_target_dir, "qwen3", tmp_path / "t")
    args = [
        "data",
        str(tmp_path / "c.yaml"),
        f"target={target}",
        f"data_files={rows_file}",
        f"data_cache_dir={tmp_path / 'c'}",
        "data_strict=true",
    ]
    (tmp_path / "c.yaml").write_text("max_seq_length: 8\n")
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"specdraft: error: {rows_file}:4: no assistant turn (nothing to learn from)"
    ]
    assert not list((tmp_path / "c").glob("*/meta.json"))  # nothing half-built left behind


def test_tokens_and_masks_in_the_cache_are_the_rows_own(tiny_target_dir, rows_file, tmp_path):
    from transformers import AutoTokenizer
    from specdraft.data.chat import tokenize_conversation
    from specdraft.data.sources import iter_records, normalise_conversation

    target = template_target(tiny_target_dir, "qwen3", tmp_path / "t")
    tokenizer = AutoTokenizer.from_pretrained(target)
    cache = tmp_path / "cache"
    build_packed_cache([str(rows_file)], tokenizer, 8, cache, log=lambda *_: None)
    expected_ids, expected_mask = [], []
    for where, record in list(iter_records([str(rows_file)]))[:3]:
        ids, mask = tokenize_conversation(tokenizer, normalise_conversation(record, where), where)
        expected_ids += ids
        expected_mask += mask
    assert np.fromfile(cache / "tokens.bin", dtype=np.uint32).tolist() == expected_ids
    assert np.fromfile(cache / "loss_mask.bin", dtype=np.uint8).tolist() == expected_mask


TOOL_CALL = {
    "messages": [  # OpenAI's tool-call format: the assistant's content null beside tool_calls
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "assistant", "content": "It is 18C."},
    ]
}
NULL_SYSTEM = {
    "messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}


@pytest.fixture
def tool_rows_command(tiny_target_dir, tmp_path):
    """`specdraft data` arguments for good rows with a tool-call row (line 2) and a null-content row (line 4)."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [ROWS[0], TOOL_CALL, ROWS[1], NULL_SYSTEM]))
    (tmp_path / "c.yaml").write_text("max_seq_length: 8\n")
    target = template_target(tiny_target_dir, "qwen3", tmp_path / "t")
    return path, [
        "data",
        str(tmp_path / "c.yaml"),
        f"target={target}",
        f"data_files={path}",
        f"data_cache_dir={tmp_path / 'c'}",
    ]


def test_the_command_counts_tool_turn_and_null_content_rows_and_succeeds(tool_rows_command):
    path, args = tool_rows_command
    done = subprocess.run(
        [sys.executable, "-m", "specdraft.cli", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1:5] == ["rows: 4", "skipped rows: 2", f"  tool turn: 1 ({path}:2)", f"  null content: 1 ({path}:4)"]
    assert lines[-1] == f"skipped 2 of 4 rows: tool turn ({path}:2), null content ({path}:4)"
    assert done.stderr.splitlines()[-1] == f"data: {lines[-1]}"  # the line train logs


def test_data_strict_refuses_a_tool_turn_in_one_line(tool_rows_command, capsys):
    from specdraft.cli import main

    path, args = tool_rows_command
    assert main(args + ["data_strict=true"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"specdraft: error: {path}:2: tool turn: turn 1 carries 'tool_calls' (tool calls are not trained yet)"
    ]


@pytest.mark.parametrize(
    "rows, why",
    [
        ([ROWS[0]], "only {tokens} tokens in total, fewer than max_seq_length=1024"),
        ([ROWS[3], ROWS[4]], "only 0 tokens in total, fewer than max_seq_length=1024"),  # every row skipped
    ],
)
def test_a_sample_too_small_to_train_on_is_shown_and_training_refuses_it_in_one_line(
    tiny_target_dir, tmp_path, rows, why, capsys
):
    """A checking command shows what the files hold, even a sample smaller than one sequence;
    training on the same cache still refuses, in one line, naming the same reason."""
    from specdraft.cli import main

    target = template_target(tiny_target_dir, "qwen3", tmp_path / "t")
    data = tmp_path / "sample.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None, [f"target={target}", f"data_files={data}", "max_seq_length=1024", f"data_cache_dir={tmp_path / 'cache'}"]
    )
    out, _ = report(cfg, show=1)
    meta = json.loads(next((tmp_path / "cache").glob("*/meta.json")).read_text())
    expected = "training would refuse this data: data_files: " + why.format(tokens=meta["tokens"])
    assert f"rows: {len(rows)}" in out.splitlines() and expected in out.splitlines()
    kept = [r for r in rows if r is ROWS[0]]
    assert out.count("\n== ") == len(kept)  # --show prints the conversation it has
    json_out, _ = report(cfg, as_json=True)
    assert [json.loads(x).get("skipped") for x in json_out.splitlines()] == [
        None if r is ROWS[0] else {id(ROWS[3]): "no assistant turn", id(ROWS[4]): "empty answer"}[id(r)] for r in rows
    ]
    # the command exits 2 where training would refuse (`specdraft data ... && specdraft train ...` stops)
    data_args = [
        f"target={target}",
        f"data_files={data}",
        "max_seq_length=1024",
        f"data_cache_dir={tmp_path / 'cache'}",
    ]
    (tmp_path / "empty.yaml").write_text("{}\n")
    assert main(["data", str(tmp_path / "empty.yaml"), *data_args]) == 2
    capsys.readouterr()
    # train reads the cache the command built, and refuses in one line
    (tmp_path / "c.yaml").write_text("max_seq_length: 1024\n")
    for weights in Path(tiny_target_dir).iterdir():  # the template's target, with weights to train on
        if not (target / weights.name).exists():
            (target / weights.name).symlink_to(weights)
    assert (
        main(
            [
                "train",
                str(tmp_path / "c.yaml"),
                f"target={target}",
                f"data_files={data}",
                f"data_cache_dir={tmp_path / 'cache'}",
                f"output_dir={tmp_path / 'run'}",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.splitlines()[-1] == "specdraft: error: data_files: " + why.format(
        tokens=meta["tokens"]
    )
