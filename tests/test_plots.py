"""`specdraft eval --plot` and `bench/acceptance.py --plot`: acceptance per draft position and tau
per drafter as bar charts; matplotlib is an optional extra, and its absence is one line."""

import sys

import pytest

from specdraft.cli import main
from specdraft.decode.report import acceptance_figure, plot_acceptance
from specdraft.errors import SpecdraftError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORTS = [
    ("GLIDE", {"tau": 3.25, "acceptance_per_position": [0.9, 0.7, 0.5]}),
    ("prompt lookup", {"tau": 1.5, "acceptance_per_position": [0.4, 0.1]}),
]


def bar_heights(axes):
    return [round(patch.get_height(), 6) for patch in axes.patches]


def test_the_figure_holds_acceptance_per_position_and_tau_per_drafter():
    import matplotlib.pyplot as plt

    fig = acceptance_figure(REPORTS)
    by_position, by_drafter = fig.axes
    assert bar_heights(by_position) == [0.9, 0.7, 0.5, 0.4, 0.1]  # each drafter's positions
    assert [t.get_text() for t in by_position.get_legend().get_texts()] == ["GLIDE", "prompt lookup"]
    assert bar_heights(by_drafter) == [3.25, 1.5, 1.0]  # each drafter, then the target alone
    assert [t.get_text() for t in by_drafter.get_xticklabels()] == ["GLIDE", "prompt lookup", "target alone"]
    plt.close(fig)


def test_the_plot_is_a_png(tmp_path):
    plot_acceptance(REPORTS, tmp_path / "acceptance.png")
    data = (tmp_path / "acceptance.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError


def test_without_matplotlib_eval_plot_is_one_line_before_any_work(no_matplotlib, tmp_path, capsys):
    from specdraft.commands.evaluate import evaluate

    with pytest.raises(SpecdraftError, match=r"^--plot: matplotlib is not installed; pip install specdraft\[plots\]$"):
        evaluate(tmp_path / "no-such-run", tmp_path / "prompts.jsonl", plot_path=tmp_path / "a.png")
    code = main(
        [
            "eval",
            str(tmp_path / "no-such-run"),
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--plot",
            str(tmp_path / "a.png"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err == "specdraft: error: --plot: matplotlib is not installed; pip install specdraft[plots]\n"
    assert not (tmp_path / "a.png").exists()


def test_without_matplotlib_the_acceptance_bench_plot_is_one_line(no_matplotlib, tmp_path, capsys):
    from test_bench import load_bench

    bench = load_bench("acceptance")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--plot", str(tmp_path / "a.png"), "--draft", str(tmp_path / "no-such-run")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "bench/acceptance.py: --plot: matplotlib is not installed; pip install specdraft[plots]\n"
    )
