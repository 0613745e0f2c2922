"""Offline training text for distillation (specdraft/demo/text_data.py): the stdlib functions as
written, never a held-out prompt, and `specdraft demo --data text` training on it with a teacher
term."""

import json
import shutil

import pytest

from specdraft.config import PACKAGED_CONFIGS
from specdraft.demo import text_data
from specdraft.demo.corpus import SourceFile
from specdraft.demo.text_data import TEXT_BYTES, distillation_overrides, ensure_text_data, text_rows

# A corpus of one file, and by hand the chats it gives: each documented function with a body after
# its docstring, in file order, dedented; the others (no docstring, nothing after it) give none.
SHAPES = SourceFile(
    "shapes.py",
    '''"""Shapes."""


def area(w, h):
    """The area of a w by h rectangle."""
    return w * h


def undocumented(x):
    return x


class Square:
    def side(self):
        """Its side."""
        if self.big:
            return 2
        return 1

    def only_doc(self):
        """Nothing after the docstring."""


def perimeter(w, h):
    """The perimeter.

    Twice the sum of the sides.
    """
    total = w + h
    return 2 * total


async def fetch(url):
    """Fetch url."""
    return await get(url)


def scale(x):
    """Scaled."""

    return 3 * x
''',
)
ASK = "Complete this Python function:\n\n"
AREA = (ASK + 'def area(w, h):\n    """The area of a w by h rectangle."""', "    return w * h")
SIDE = (ASK + 'def side(self):\n    """Its side."""', "    if self.big:\n        return 2\n    return 1")
PERIMETER = (
    ASK + 'def perimeter(w, h):\n    """The perimeter.\n\n    Twice the sum of the sides.\n    """',
    "    total = w + h\n    return 2 * total",
)
FETCH = (ASK + 'async def fetch(url):\n    """Fetch url."""', "    return await get(url)")
SCALE = (ASK + 'def scale(x):\n    """Scaled."""', "    return 3 * x")


def chat(prompt: str, answer: str) -> dict:
    return {"conversations": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


@pytest.fixture
def shapes_corpus(monkeypatch):
    """text_rows reads SHAPES as its corpus; the (bytes, seed) it asked for are recorded."""
    asked = []
    monkeypatch.setattr(text_data, "read_corpus", lambda max_bytes, seed: asked.append((max_bytes, seed)) or [SHAPES])
    return asked


def test_the_text_is_every_function_as_written_but_the_held_out_ones(shapes_corpus):
    assert text_rows(7, set()) == [chat(*f) for f in (AREA, SIDE, PERIMETER, FETCH, SCALE)]
    assert text_rows(7, {PERIMETER[0], ASK + "def elsewhere():"}) == [chat(*f) for f in (AREA, SIDE, FETCH, SCALE)]
    assert shapes_corpus == [(TEXT_BYTES, 7), (TEXT_BYTES, 7)]


def test_the_stdlib_text_holds_the_held_out_prompts_nowhere(tiny_assets):
    """On the real corpus: the held-out prompts are its functions, each a row until held out, and
    removing them removes nothing else."""
    _, data = tiny_assets
    held_out = {json.loads(line)["prompt"] for line in data.prompts_file.read_text().splitlines()}
    every, rows = text_rows(0, set()), text_rows(0, held_out)
    prompts = [r["conversations"][0]["content"] for r in every]
    assert held_out and held_out <= set(prompts) and len(set(prompts)) == len(prompts)
    assert rows == [r for r in every if r["conversations"][0]["content"] not in held_out]
    assert all(p.startswith(ASK) for p in prompts) and all(r["conversations"][1]["content"].strip() for r in every)
    assert len(rows) > 1000  # enough text for hundreds of thousands of tokens


def test_the_text_is_built_once_and_rebuilt_when_the_held_out_prompts_change(shapes_corpus, tmp_path):
    logged = []
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PERIMETER[0]}) + "\n")
    files = ensure_text_data(tmp_path, "tiny", prompts, 0, log=logged.append)
    assert [[json.loads(line) for line in f.read_text().splitlines()] for f in files] == [
        [chat(*f)]
        for f in (AREA, SIDE, FETCH, SCALE)  # 4 rows in 4 files
    ]
    before = {f: f.stat().st_mtime_ns for f in files}
    assert ensure_text_data(tmp_path, "tiny", prompts, 0, log=logged.append) == files
    assert {f: f.stat().st_mtime_ns for f in files} == before and "reusing cached text" in logged[-1]
    other = tmp_path / "other_prompts"
    other.mkdir()
    (other / "prompts.jsonl").write_text(json.dumps({"prompt": AREA[0]}) + "\n")
    rebuilt = [
        json.loads(line)
        for f in ensure_text_data(tmp_path, "tiny", other / "prompts.jsonl", 0, log=logged.append)
        for line in f.read_text().splitlines()
    ]
    assert rebuilt == [chat(*f) for f in (SIDE, PERIMETER, FETCH, SCALE)]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("demo", ["draft.loss=kl"]),
        ("demo-dflash", ["draft.loss=kl"]),
        ("demo-eagle3", []),
        ("demo-peagle", []),
        ("demo-dspark", []),
        ("demo-mtp", []),
    ],
)
def test_text_is_learnt_through_a_teacher_term(name, expected):
    """GLIDE and DFlash default to CE (the text itself): kl instead; EAGLE-3's soft CE, P-EAGLE's KL
    and DSpark's configured TV already read the target's distribution; MTP has no draft.loss."""
    assert distillation_overrides(PACKAGED_CONFIGS / f"{name}.yaml") == expected


def test_demo_trains_on_the_text_with_distillation(tiny_assets, tmp_path, monkeypatch, capsys):
    """`demo --data text` needs the target and the held-out prompts alone: no answer is generated (a
    fresh home holding only the target), and the prompts are the dataset's own."""
    from specdraft.cli import main

    home = tmp_path / "home"
    shutil.copytree(tiny_assets[0], home / "tiny" / "target")  # its stamp: reused, not rebuilt
    monkeypatch.setenv("SPECDRAFT_HOME", str(home))
    out = tmp_path / "run"
    assert (
        main(
            [
                "demo",
                "--preset",
                "tiny",
                "--data",
                "text",
                f"output_dir={out}",
                "max_steps=2",
                "save_steps=2",
                "eval_steps=0",
                "max_seq_length=128",
                "per_device_batch_size=2",
                "logging_steps=1",
            ]
        )
        == 0
    )
    config = (out / "config.yaml").read_text()
    assert "loss: kl" in config and f"{home}/tiny/text/shard-00000.jsonl" in config
    assert sorted(p.name for p in (home / "tiny").iterdir()) == ["prompts", "target", "text"]  # no data/
    assert (home / "tiny" / "prompts" / "prompts.jsonl").read_text() == tiny_assets[1].prompts_file.read_text()
    assert f"eval_prompts: {home}/tiny/prompts/prompts.jsonl" in config
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] and all("objective/kl" in r for r in logged)


def test_demo_text_refuses_an_answer_temperature_in_one_line(capsys):
    from specdraft.cli import main

    assert main(["demo", "--preset", "tiny", "--data", "text", "--answer-temperature", "0.7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--answer-temperature" in err and "--data text generates none" in err
