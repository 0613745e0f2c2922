"""`specdraft regenerate` on 2 ranks (torchrun): the rows shared, one manifest counting them all."""

import hashlib
import json
from pathlib import Path

from helpers import torchrun
from test_regenerate import config, out_rows, prompts_from, source

from specdraft.regenerate.run import regenerate

SCRIPT = Path(__file__).with_name("regenerate_ranks_script.py")


def test_two_ranks_share_the_rows_and_rank_0_alone_writes_the_manifest_counting_both(
    tiny_target_dir, tiny_data, tmp_path
):
    """Each rank (RANK / WORLD_SIZE) takes the rows its id hashes to: every row is written exactly
    once, with the answers one process writes (seeds come from the row, not the process). Global
    rank 0 alone writes manifest.json (both ranks have LOCAL_RANK 0, as on two nodes), and its
    counts are every rank's rows, though rank 1 (slowed) finishes last."""
    data = source(tmp_path, prompts_from(tiny_data, 12))
    shared = tmp_path / "shared"
    run = torchrun(
        SCRIPT,
        tmp_path,
        "regenerate",
        "--target",
        tiny_target_dir,
        "--data",
        data,
        "--out",
        shared,
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.7",
        "--batch-size",
        "1",
        "--concurrency",
        "1",
        "--rows-per-shard",
        "2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = out_rows(shared)
    for rank in (0, 1):  # each rank wrote exactly the rows whose id hashes to it
        own = [
            json.loads(line) for p in shared.glob(f"shard-r{rank:03d}-*.jsonl") for line in p.read_text().splitlines()
        ]
        assert own and all(
            int(hashlib.sha256(f"{r['id']}#{r['sample']}".encode()).hexdigest(), 16) % 2 == rank for r in own
        )
    writes = {rank: json.loads((tmp_path / f"writes-r{rank}.json").read_text()) for rank in (0, 1)}
    assert "manifest.json" in writes[0] and "manifest.json" not in writes[1]
    manifest = json.loads((shared / "manifest.json").read_text())
    errors = sum(len((shared / f"errors-r{rank:03d}.jsonl").read_text().splitlines()) for rank in (0, 1))
    assert manifest["counts"] == {
        "rows_written": len(rows),
        "errors_last_run": errors,
        "truncated_answers": sum(
            bool(m.get("truncated")) for r in rows for m in r["conversations"] if m["role"] == "assistant"
        ),
        "answer_tokens": sum(len(m["token_ids"]) for r in rows for m in r["conversations"] if m["role"] == "assistant"),
    }
    assert manifest["shards"] == sorted(p.name for p in shared.glob("shard-*.jsonl"))
    single = tmp_path / "single"
    regenerate(config(tiny_target_dir, data, single, temperature=0.7), log=lambda m: None, progress_bar=False)
    keys = [(r["id"], r["sample"]) for r in rows]
    single_rows = out_rows(single)
    assert len(keys) == len(set(keys)) == len(single_rows) >= 10  # an empty sampled answer is an error row
    answers = lambda rs: {(r["id"], r["sample"]): r["conversations"][-1]["content"] for r in rs}  # noqa: E731
    assert answers(rows) == answers(single_rows)
