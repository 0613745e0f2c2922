"""Training in-process on one CPU rank: the loss really falls, and ZeRO stages agree."""

import json
import math

import pytest

from helpers import train_run


def test_thirty_steps_lower_the_loss(tiny_target_dir, data_dir, tmp_path, capsys):
    result = train_run(tiny_target_dir, data_dir, tmp_path, "long", max_steps=30, save_steps=30)
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < first - 0.5, result.losses  # nats: from ~ln(vocab) to well below
    # what was logged is what was measured
    logged = [json.loads(line) for line in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 31))
    assert logged[-1]["loss"] == pytest.approx(result.losses[-1])
    assert (tmp_path / "long" / "tb").is_dir()
    # `specdraft config` with the run's settings prints exactly the config.yaml the run recorded
    from specdraft.cli import main

    from helpers import run_overrides

    (tmp_path / "empty.yaml").write_text("{}\n")
    overrides = run_overrides(
        tiny_target_dir, data_dir, tmp_path / "long", tmp_path / "cache", max_steps=30, save_steps=30
    )
    capsys.readouterr()  # what training printed (DeepSpeed's warnings on stdout) is not the command's
    assert main(["config", str(tmp_path / "empty.yaml"), *overrides]) == 0
    assert capsys.readouterr().out == (tmp_path / "long" / "config.yaml").read_text()


def test_the_summary_line_names_the_progress_bars_loss_windows(tiny_target_dir, data_dir, tmp_path, monkeypatch):
    """`loss=` on the bar is the token-weighted loss of a logging window; the summary's `loss A -> B`
    shows the first and last of those same numbers, each with its steps (not two single steps
    under the same name)."""
    from specdraft.config import load_config
    from specdraft.train import loop

    from helpers import run_overrides

    postfixes, lines = [], []

    class Bar:  # the loop's tqdm, recording what the bar shows
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            pass

        def set_postfix(self, values=None, **kwargs):
            postfixes.append(dict(values or {}, **kwargs))

        def close(self):
            pass

    monkeypatch.setattr("tqdm.tqdm", Bar)
    cfg = load_config(
        None,
        run_overrides(
            tiny_target_dir, data_dir, tmp_path / "w", tmp_path / "cache", max_steps=7, save_steps=7, logging_steps=3
        ),
    )
    result = loop.train(cfg, log=lines.append)
    windows = result.window_losses[None]
    assert [(a, b) for a, b, _ in windows] == [(1, 3), (4, 6), (7, 7)]
    assert [p["loss"] for p in postfixes] == [f"{loss:.3f}" for _, _, loss in windows]
    (done,) = [line for line in lines if line.startswith("done: ")]
    assert f"loss {windows[0][2]:.3f} (steps 1-3) -> {windows[-1][2]:.3f} (step 7), " in done


def test_zero_stages_0_to_3_run_and_agree_on_the_first_loss(tiny_target_dir, data_dir, tmp_path):
    losses = {
        stage: train_run(
            tiny_target_dir, data_dir, tmp_path, f"z{stage}", zero_stage=stage, max_steps=3, save_steps=3
        ).losses
        for stage in (0, 1, 2, 3)
    }
    for stage in (1, 2, 3):
        assert len(losses[stage]) == 3
        assert losses[stage][0] == pytest.approx(losses[0][0], abs=1e-6)


def test_gradient_accumulation_and_bf16_train(tiny_target_dir, data_dir, tmp_path):
    result = train_run(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "bf16",
        precision="bf16",
        gradient_accumulation_steps=2,
        max_steps=4,
        save_steps=4,
    )
    assert len(result.losses) == 4 and all(l == l for l in result.losses)  # finite, no NaN
    assert result.losses[-1] < result.losses[0]


def test_tau_on_held_out_prompts_is_logged_beside_the_loss_at_zero2_and_zero3(
    tiny_target_dir, tiny_data, data_dir, tmp_path, monkeypatch
):
    import specdraft.train.evals as evals
    import specdraft.train.loop as loop

    engines, gathered = [], []

    def build_engine(*args, **kwargs):
        engines.append(loop.build_engine.__wrapped__(*args, **kwargs))
        return engines[-1]

    def spy_gathered(params):
        gathered.append(params)
        return evals.gathered.__wrapped__(params)

    build_engine.__wrapped__, spy_gathered.__wrapped__ = loop.build_engine, evals.gathered
    monkeypatch.setattr(loop, "build_engine", build_engine)
    monkeypatch.setattr(evals, "gathered", spy_gathered)
    # module fetches per ZeRO-3 step (between two resets of its trace): decoding must not pile
    # thousands of calls into one step, which ZeRO-3 then records and matches quadratically
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    fetches = [0]
    most_fetches = [0]
    fetch, reset = Coordinator.fetch_sub_module, Coordinator.reset_step

    def counting_fetch(self, *args, **kwargs):
        fetches[0] += 1
        return fetch(self, *args, **kwargs)

    def counting_reset(self):
        most_fetches[0], fetches[0] = max(most_fetches[0], fetches[0]), 0
        return reset(self)

    monkeypatch.setattr(Coordinator, "fetch_sub_module", counting_fetch)
    monkeypatch.setattr(Coordinator, "reset_step", counting_reset)
    taus = {}
    for stage in (2, 3):
        gathered.clear()
        train_run(
            tiny_target_dir,
            data_dir,
            tmp_path,
            f"eval{stage}",
            zero_stage=stage,
            max_steps=4,
            save_steps=4,
            eval_steps=2,
            eval_prompts=tiny_data.prompts_file,
        )
        rows = [json.loads(l) for l in (tmp_path / f"eval{stage}" / "metrics.jsonl").read_text().splitlines()]
        taus[stage] = [(r["step"], r["eval/tau"]) for r in rows if "eval/tau" in r]
        assert [s for s, _ in taus[stage]] == [2, 4]
        assert all(1.0 <= t <= 5.0 for _, t in taus[stage])  # gamma = max_lag 4: tau in [1, gamma + 1]
        # what tau gathers (for the whole measurement under ZeRO-3): the draft and lm_head, never
        # the target's layers (those come one module at a time through ZeRO-3's hooks)
        module = engines[-1].module  # a replicated target holds its weights as buffers
        names = {id(t): name for name, t in [*module.named_parameters(), *module.named_buffers()]}
        assert len(gathered) == 2 and all(len(params) > 0 for params in gathered)
        assert {names[id(p)] for params in gathered for p in params} == {
            n for n in names.values() if n.startswith("draft_model.")
        } | {"lm_head.weight"}
    assert taus[2] == taus[3]  # the same draft decodes the same way under either stage


def test_zero3_target_replicated_or_partitioned_trains_the_same(tiny_target_dir, data_dir, tmp_path, monkeypatch):
    """target_placement: replicated keeps the frozen target out of ZeRO-3's partition (no
    ds_id, whole tensors), partitioned lets ZeRO-3 shard it; the draft trains identically."""
    from specdraft.train import loop

    engines = {}
    original = loop.build_engine

    def spy(cfg, model, total_steps, placement, **kwargs):
        engines[placement] = engine = original(cfg, model, total_steps, placement, **kwargs)
        return engine

    monkeypatch.setattr(loop, "build_engine", spy)
    losses = {
        p: train_run(
            tiny_target_dir, data_dir, tmp_path, f"z3{p}", zero_stage=3, target_placement=p, max_steps=3, save_steps=3
        ).losses
        for p in ("replicated", "partitioned")
    }
    assert losses["replicated"] == pytest.approx(losses["partitioned"], abs=1e-5)
    replicated, partitioned = engines["replicated"].module, engines["partitioned"].module
    assert not any(hasattr(t, "ds_id") for t in replicated.model.buffers())
    assert list(replicated.model.parameters()) == [] and replicated.lm_head.weight.numel() > 0
    assert all(hasattr(p, "ds_id") for p in replicated.draft_model.parameters())  # the draft is still ZeRO-3's
    assert all(hasattr(p, "ds_id") for p in partitioned.model.parameters())


def test_a_distillation_objective_trains_under_zero3_and_tau_is_measured_sampled(
    tiny_target_dir, tiny_data, data_dir, tmp_path
):
    """draft.loss reads the target's distribution through the captured final hidden state (lm_head
    gathered by ZeRO-3), here on every token (distill_tokens: all); its terms are logged, TV
    falls, and eval_temperature samples the tau."""
    result = train_run(
        tiny_target_dir,
        data_dir,
        tmp_path,
        "distill",
        zero_stage=3,
        max_steps=12,
        save_steps=12,
        eval_steps=12,
        eval_prompts=tiny_data.prompts_file,
        eval_temperature=0.7,
        **{"draft.loss": "0.9*tv + 0.1*ce", "draft.distill_temperature": 0.7, "draft.distill_tokens": "all"},
    )
    rows = [json.loads(l) for l in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "objective/tv" in r]
    assert len(train_rows) == 12 and all("objective/ce" in r for r in train_rows)
    for r in train_rows:  # the loss backward saw is the weighted sum of the logged terms
        assert r["loss"] == pytest.approx(0.9 * r["objective/tv"] + 0.1 * r["objective/ce"], rel=1e-6)
    assert train_rows[-1]["objective/tv"] < train_rows[0]["objective/tv"] - 0.1
    assert result.losses[-1] < result.losses[0]
    tau = [r for r in rows if "eval/tau" in r]
    assert len(tau) == 1 and 1.0 <= tau[0]["eval/tau"] <= 5.0 and 0.0 <= tau[0]["eval/tv"] <= 1.0


# -- the learning rate of the first updates -----------------------------------------------------
# learning_rate 1e-2, 3 steps, min_lr_ratio 0: linear warmup k / w, then cosine over the updates
# after it, (1 + cos(pi * (k - w - 1) / (3 - w))) / 2, written out by hand.
FIRST_THREE_LRS = {
    0: [1e-2, 7.5e-3, 2.5e-3],  # no warmup: update 1 at the peak, cos(pi/3), cos(2 pi/3)
    1: [1e-2, 1e-2, 5e-3],  # the peak at update 1, cosine from update 2
    4: [2.5e-3, 5e-3, 7.5e-3],  # still warming up: 1/4, 2/4, 3/4
}


@pytest.mark.parametrize("warmup", sorted(FIRST_THREE_LRS))
def test_every_update_from_the_first_runs_at_the_scheduled_learning_rate(
    warmup, tiny_target_dir, data_dir, tmp_path, monkeypatch
):
    """DeepSpeed's WarmupCosineLR ran updates 1 and 2 at lr 0, whatever the warmup: the weights
    after step 2 were the initial ones."""
    from helpers import TrainingSpy, assert_every_update_moved_everything

    spy = TrainingSpy(monkeypatch)
    train_run(tiny_target_dir, data_dir, tmp_path, "lr", max_steps=3, save_steps=3, warmup_steps=warmup)
    logged = [json.loads(line) for line in (tmp_path / "lr" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in logged if "lr" in r] == pytest.approx(FIRST_THREE_LRS[warmup], rel=1e-12)
    assert len(spy.snapshots) == 4
    assert_every_update_moved_everything(spy.snapshots)  # the first update included


def test_a_slot_saved_with_deepspeeds_scheduler_resumes_on_the_same_update():
    """Slots written before train/schedule.py hold WarmupCosineLR's state: after n updates its
    last_batch_iteration is n - 1. The schedule carries on at update n + 1; anything else is refused."""
    import torch

    from specdraft.errors import SpecdraftError
    from specdraft.train.schedule import WarmupCosine

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    schedule = WarmupCosine(optimizer, warmup=4, total=10, min_ratio=0.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-3)  # update 1
    schedule.load_state_dict({"last_batch_iteration": 1})  # two updates taken
    assert schedule.updates == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-3)  # update 3
    assert schedule.lr_of_last_update() == pytest.approx(5e-3)
    schedule.load_state_dict(schedule.state_dict() | {"updates": 5})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * (1 + math.cos(math.pi / 6)) / 2)  # update 6
    with pytest.raises(SpecdraftError, match=r"holds \['step_count'\]: neither"):
        schedule.load_state_dict({"step_count": 3})
