"""A target without a chat template (a base model): plain-text rows train on it, every token after
the first a label; a chat row is refused in one line naming the missing template and where to put
one, by `data`, `train`, `regenerate` (before anything is written) and `eval`'s prompts."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from specdraft import cli
from specdraft.data.packing import TOKEN_DTYPE, open_packed_cache, packed_cache_dir
from specdraft.decode.prompts import read_prompts
from specdraft.errors import SpecdraftError
from specdraft.target.checks import has_chat_template

CHAT = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n"]


@pytest.fixture
def base_target(tiny_target_dir, tmp_path):
    """The tiny target's weights and tokenizer, its chat template removed."""
    out = tmp_path / "base"
    out.mkdir()
    for path in tiny_target_dir.iterdir():
        if path.name not in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json"):
            (out / path.name).symlink_to(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    assert not has_chat_template(out) and has_chat_template(tiny_target_dir)
    return out


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def refusal(where) -> str:
    return (
        f"{where}: the target's tokenizer has no chat template (a base model?), so chat rows cannot be "
        f"rendered: save one as chat_template.jinja in the target's directory, or give plain-text rows "
        '({"text": "..."})'
    )


def test_plain_text_rows_pack_whole_with_every_token_after_the_first_a_label(base_target, tmp_path, capsys):
    data = write_rows(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS * 8])
    keys = [f"target={base_target}", f"data_files={data}", "max_seq_length=64", f"data_cache_dir={tmp_path / 'c'}"]
    (tmp_path / "c.yaml").write_text("{}\n")
    assert cli.main(["data", str(tmp_path / "c.yaml"), *keys]) == 0
    cache_dir = packed_cache_dir([str(data)], str(base_target), 64, None, tmp_path / "c")
    packed = open_packed_cache(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    expected = [tokenizer(t)["input_ids"] for t in TEXTS * 8]
    assert packed.meta["conversations"] == 16 and packed.meta["tokens"] == sum(map(len, expected))
    assert packed.meta["assistant_tokens"] == sum(len(ids) - 1 for ids in expected)
    # the flat files: every row's ids as the tokenizer encodes it, every token after its first a label
    tokens = np.fromfile(cache_dir / "tokens.bin", dtype=TOKEN_DTYPE).tolist()
    mask = np.fromfile(cache_dir / "loss_mask.bin", dtype=np.uint8).tolist()
    assert tokens == [t for ids in expected for t in ids]
    assert mask == [m for ids in expected for m in [0] + [1] * (len(ids) - 1)]


def test_a_chat_row_is_refused_in_one_line_by_data_train_regenerate_and_eval(base_target, tmp_path, capsys):
    data = write_rows(tmp_path / "chat.jsonl", [{"text": TEXTS[0]}, CHAT])
    keys = [f"target={base_target}", f"data_files={data}", "max_seq_length=64", f"data_cache_dir={tmp_path / 'c'}"]
    (tmp_path / "c.yaml").write_text("{}\n")
    for command in (["data"], ["train"]):
        capsys.readouterr()
        run_keys = keys + ([f"output_dir={tmp_path / 'run'}"] if command == ["train"] else [])
        assert cli.main([*command, str(tmp_path / "c.yaml"), *run_keys]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"specdraft: error: {refusal(f'{data}:2')}"
        assert not list((tmp_path / "c").glob("*/meta.json"))  # no packed cache left behind
    # regenerate renders every prompt with the template: refused before its output exists
    out = tmp_path / "answers"
    code = cli.main(["regenerate", "--target", str(base_target), "--data", str(data), "--out", str(out)])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"specdraft: error: --target: {base_target} has no chat template (a base model?): save one as "
        "chat_template.jinja in it to regenerate chat answers"
    )
    # eval's prompts: {"prompt": text} is the base model's raw prompt; a conversation is refused
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    prompts = write_rows(tmp_path / "p.jsonl", [{"prompt": TEXTS[0]}])
    assert read_prompts(prompts, tokenizer) == [tokenizer(TEXTS[0])["input_ids"]]
    chats = write_rows(tmp_path / "q.jsonl", [{"prompt": TEXTS[0]}, CHAT])
    with pytest.raises(SpecdraftError) as err:
        read_prompts(chats, tokenizer)
    assert str(err.value) == refusal(f"{chats}:2")
