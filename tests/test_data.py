"""Data: sources and their errors, the assistant-only loss mask, packing, the resumable sampler."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from specdraft.data.chat import tokenize_conversation
from specdraft.data.packing import build_packed_cache, open_packed_cache
from specdraft.data.sampler import ShardedBatchSampler
from specdraft.data.sources import SkippedRow, iter_conversations, normalise_conversation
from specdraft.errors import SpecdraftError


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def conversation(user="What is 2+2?", answer="It is four."):
    return {"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


# an OpenAI tool call: the assistant's content null beside its tool_calls, then the tool's result
TOOL_ROW = {
    "messages": [
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
NULL_ROW = {
    "messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(conversation()) + "\n" + "{not json\n")
    with pytest.raises(SpecdraftError, match=rf"{path}:2: not valid JSON"):
        list(iter_conversations([str(path)]))


def test_row_without_assistant_turn_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(SpecdraftError, match=rf"{path}:2: no assistant turn"):
        list(iter_conversations([str(path)]))


def test_parquet_and_sharegpt_rows_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}] * 3
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    got = list(iter_conversations([str(tmp_path / "d.parquet")]))
    assert [w for w, _ in got] == [f"{tmp_path / 'd.parquet'}: row {i}" for i in range(3)]
    assert got[0][1] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_loss_mask_covers_exactly_the_assistant_text(tokenizer):
    messages = conversation("Tell me a joke", "def f():\n    return 42")["conversations"]
    messages = messages + [{"role": "user", "content": "again"}, {"role": "assistant", "content": "x = 1"}]
    ids, mask = tokenize_conversation(tokenizer, messages, "test")
    assert len(ids) == len(mask)
    masked_text = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert "return 42" in masked_text and "x = 1" in masked_text
    assert "joke" not in masked_text and "again" not in masked_text
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "Tell me a joke" in unmasked and "return 42" not in unmasked


def test_packed_cache_round_trips_and_is_memory_mapped(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(conversation(answer="word " * (i % 7 + 1))) + "\n" for i in range(60)))
    build_packed_cache([str(path)], tokenizer, 32, tmp_path / "cache", log=lambda *_: None)
    data = open_packed_cache(tmp_path / "cache")
    assert isinstance(data.tokens, np.memmap) or isinstance(data.tokens.base, np.memmap)
    assert data.tokens.shape == (data.meta["tokens"] // 32, 32)
    first_ids, _ = tokenize_conversation(tokenizer, conversation(answer="word ")["conversations"], "x")
    assert data.tokens[0, : len(first_ids)].tolist() == first_ids[:32]
    batch = data.batch([2, 0])
    assert batch["input_ids"].shape == (2, 32) and batch["input_ids"][1].tolist() == data.tokens[0].tolist()


def test_sampler_shards_are_disjoint_and_resume_exactly():
    ranks = [ShardedBatchSampler(103, 4, r, 2, seed=7) for r in range(2)]
    epoch0 = [np.concatenate([s.next_batch() for _ in range(s.steps_per_epoch)]) for s in ranks]
    assert not set(epoch0[0]) & set(epoch0[1])
    straight = ShardedBatchSampler(103, 4, 0, 2, seed=7)
    seen = [straight.next_batch() for _ in range(20)]  # crosses into epoch 1
    resumed = ShardedBatchSampler(103, 4, 0, 2, seed=7)
    for _ in range(9):
        resumed.next_batch()
    state = resumed.state_dict()
    fresh = ShardedBatchSampler(103, 4, 0, 2, seed=7)
    fresh.load_state_dict(state)
    assert all((a == b).all() for a, b in zip(seen[9:], [fresh.next_batch() for _ in range(11)]))
    changed = ShardedBatchSampler(99, 4, 0, 2, seed=7)
    with pytest.raises(SpecdraftError, match="103 sequences"):
        changed.load_state_dict(state)


def test_packed_batches_carry_document_ids_and_per_document_positions(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    answers = ["word " * (i % 7 + 1) for i in range(40)]
    path.write_text("".join(json.dumps(conversation(answer=a)) + "\n" for a in answers))
    build_packed_cache([str(path)], tokenizer, 32, tmp_path / "cache", log=lambda *_: None)
    data = open_packed_cache(tmp_path / "cache")
    lengths = [len(tokenize_conversation(tokenizer, conversation(answer=a)["conversations"], "x")[0]) for a in answers]
    flat_starts = np.cumsum([0] + lengths[:-1])  # where each conversation begins in the stream
    for row in range(len(data)):
        batch = data.batch([row])
        docs, positions = batch["document_ids"][0].tolist(), batch["document_positions"][0].tolist()
        window = range(row * 32, row * 32 + 32)
        starts = [t - row * 32 for t in flat_starts if t in window]
        expected_docs, expected_pos, doc, pos = [], [], 0, 0
        for t in range(32):
            if t in starts and t > 0:
                doc, pos = doc + 1, 0
            expected_docs.append(doc)
            expected_pos.append(pos)
            pos += 1
        assert docs == expected_docs and positions == expected_pos, row


def _steps(samplers, accumulation, steps):
    """The sequences of each optimizer step, all ranks, in micro-batch order."""
    out = []
    for _ in range(steps):
        batches = [[s.next_batch() for s in samplers] for _ in range(accumulation)]
        out.append([int(i) for micro in batches for batch in micro for i in batch])
    return out


@pytest.mark.parametrize("new_world,new_accumulation", [(1, 4), (4, 1)])
def test_sampler_position_carries_over_to_another_world_size(new_world, new_accumulation):
    """Global batch 12 = 2 ranks x 3 x 2 accumulation: stop after 5 steps, resume at another world
    size with the same global batch. Every step sees the sequences a straight run's step sees,
    in the same micro-batches; across the epoch none is repeated or skipped."""
    straight = _steps([ShardedBatchSampler(100, 3, r, 2, seed=5, accumulation=2) for r in range(2)], 2, 8)
    before_samplers = [ShardedBatchSampler(100, 3, r, 2, seed=5, accumulation=2) for r in range(2)]
    before = _steps(before_samplers, 2, 5)
    after_samplers = [
        ShardedBatchSampler(100, 3, r, new_world, seed=5, accumulation=new_accumulation) for r in range(new_world)
    ]
    for sampler in after_samplers:
        sampler.load_state_dict(before_samplers[0].state_dict())
    after = _steps(after_samplers, new_accumulation, 3)
    assert before + after == straight
    seen = [i for step in before + after for i in step]
    assert len(seen) == len(set(seen)) == 96  # 8 whole global batches of 12; the 4 left over are dropped
    mismatched = ShardedBatchSampler(100, 3, 0, 3, seed=5)
    with pytest.raises(SpecdraftError, match="global batch is 12"):
        mismatched.load_state_dict(before_samplers[0].state_dict())


def test_a_resume_in_a_later_epoch_continues_that_epochs_order():
    """Stopped in epoch 1 (its own permutation, not epoch 0's): the resumed sampler continues that
    epoch's order where it stopped. 40 sequences, global batch 8: 5 steps per epoch."""
    straight = [ShardedBatchSampler(40, 4, r, 2, seed=11) for r in range(2)]
    seen = _steps(straight, 1, 12)  # epochs 0, 1 and two steps of epoch 2
    assert sorted(seen[0] + seen[1] + seen[2] + seen[3] + seen[4]) == list(range(40))
    assert seen[5:10] != seen[0:5]  # each epoch its own order
    stopped = [ShardedBatchSampler(40, 4, r, 2, seed=11) for r in range(2)]
    _steps(stopped, 1, 7)
    resumed = [ShardedBatchSampler(40, 4, r, 2, seed=11) for r in range(2)]
    for sampler in resumed:
        sampler.load_state_dict(stopped[0].state_dict())
    assert resumed[0].state_dict()["epoch"] == 1
    assert _steps(resumed, 1, 5) == seen[7:12]


@pytest.mark.parametrize(
    "turns,reason,detail",
    [
        (TOOL_ROW["messages"], "tool turn", "tool turn: turn 1 carries 'tool_calls'"),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "18C"},
                {"role": "assistant", "content": "a"},
            ],
            "tool turn",
            "tool turn: turn 1 has role 'tool'",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "function_call": {"name": "f"}},
                {"role": "function", "name": "f", "content": "1"},
                {"role": "assistant", "content": "a"},
            ],
            "tool turn",
            "tool turn: turn 1 carries 'function_call'",
        ),
        (
            [
                {"from": "human", "value": "q"},
                {"from": "function_call", "value": "{}"},
                {"from": "observation", "value": "1"},
                {"from": "gpt", "value": "a"},
            ],
            "tool turn",
            "tool turn: turn 1 has role 'function_call'",
        ),
        (NULL_ROW["messages"], "null content", "null content: turn 0 (system) has content null"),
        (
            [{"from": "human", "value": None}, {"from": "gpt", "value": "a"}],
            "null content",
            "null content: turn 0 (human) has value null",
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
            "null content",
            "null content: turn 1 (assistant) has content null",
        ),
        (
            [
                {"role": "system", "content": None},
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "1"},
                {"role": "assistant", "content": "a"},
            ],
            "tool turn",
            "tool turn: turn 2 has role 'tool'",
        ),  # one reason: tool
    ],
    ids=[
        "openai-tool-call",
        "tool-role",
        "openai-function-call",
        "sharegpt-tools",
        "null-system",
        "sharegpt-null",
        "null-answer",
        "tool-and-null",
    ],
)
def test_tool_and_null_content_turns_skip_their_row_with_the_reason(turns, reason, detail):
    for require_answer in (True, False):  # train's reading and regenerate's
        with pytest.raises(SkippedRow) as err:
            normalise_conversation({"messages": turns}, "d.jsonl:7", require_answer=require_answer)
        assert err.value.reason == reason and str(err.value).startswith(f"d.jsonl:7: {detail}")


def test_only_a_real_tool_call_skips_and_a_malformed_turn_stays_an_error():
    with pytest.raises(SkippedRow, match="tool turn"):
        normalise_conversation(
            {"messages": [{"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]}, "x"
        )
    # a malformed turn beside a skipped one still names the file's mistake (not counted as a skip)
    for bad in (
        [{"role": "tool", "content": "1"}, "not a turn"],
        [{"role": "tool", "content": "1"}, {"role": "bot"}],
        [{"role": "bot", "content": None}, {"role": "assistant", "content": "a"}],
    ):
        with pytest.raises(SpecdraftError) as err:
            normalise_conversation({"messages": bad}, "x")
        assert not isinstance(err.value, SkippedRow), bad
    # empty or null tool_calls / function_call (common in exports) call nothing: the row is trained
    plain = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": [], "function_call": None},
    ]
    assert normalise_conversation({"messages": plain}, "x") == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]


def test_tool_turn_and_null_content_rows_are_skipped_counted_and_the_rest_packed(tokenizer, tmp_path):
    good = [conversation(f"question {i}", f"answer number {i}") for i in range(3)]
    mixed = write_rows(tmp_path / "mixed.jsonl", [good[0], TOOL_ROW, good[1], NULL_ROW, good[2]])
    clean = write_rows(tmp_path / "clean.jsonl", good)
    logged = []
    meta = build_packed_cache([str(mixed)], tokenizer, 8, tmp_path / "mixed", log=logged.append)
    expected = build_packed_cache([str(clean)], tokenizer, 8, tmp_path / "clean", log=lambda *_: None)
    for name in ("tokens.bin", "loss_mask.bin", "doc_start.bin"):  # the good rows, token for token
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    assert [meta[k] for k in ("conversations", "tokens", "assistant_tokens", "sequences")] == [
        expected[k] for k in ("conversations", "tokens", "assistant_tokens", "sequences")
    ] and meta["conversations"] == 3
    assert {reason: (e["count"], e["rows"]) for reason, e in meta["skipped"].items()} == {
        "tool turn": (1, [f"{mixed}:2"]),
        "null content": (1, [f"{mixed}:4"]),
    }
    assert logged[-1] == f"data: skipped 2 of 5 rows: tool turn ({mixed}:2), null content ({mixed}:4)"  # train's log
    rows = [json.loads(line) for line in (tmp_path / "mixed" / "rows.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in rows] == [None, "tool turn", None, "null content", None]


def test_regenerate_skips_tool_and_null_content_rows_with_their_reason(tiny_target_dir, tmp_path):
    from specdraft.regenerate.backends import Answer
    from specdraft.regenerate.run import RegenerateConfig, regenerate

    class Echo:  # answers at once: which rows are asked is what is tested
        name = "hf"

        def generate(self, requests, progress=lambda n: None):
            return [Answer(text="re: " + r.messages[-1]["content"], tokens=1) for r in requests]

    data = write_rows(tmp_path / "in.jsonl", [{"prompt": "hi"}, TOOL_ROW, NULL_ROW])
    logged = []
    summary = regenerate(
        RegenerateConfig(target=str(tiny_target_dir), data=[str(data)], out=str(tmp_path / "o")),
        Echo(),
        log=logged.append,
        progress_bar=False,
    )
    assert (summary["rows"], summary["skipped"], summary["failed"]) == (1, 2, 0)
    errors = [json.loads(line) for line in (tmp_path / "o" / "errors.jsonl").read_text().splitlines()]
    assert [(e["source"], e["kind"], e["reason"]) for e in errors] == [
        (f"{data}:2", "skipped", "tool turn: turn 1 carries 'tool_calls' (tool calls are not trained yet)"),
        (f"{data}:3", "skipped", "null content: turn 0 (system) has content null"),
    ]
    assert "; 2 rows skipped (tool turn 1, null content 1)" in logged[-1]
