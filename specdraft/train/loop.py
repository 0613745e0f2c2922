"""train() and forward_step(): the DeepSpeed training loop, readable top to bottom.

    batch -> target features (no_grad) -> draft loss -> engine.backward / engine.step
          -> maybe log / eval / save        (the last step goes through the same save path)

A run of several drafts (`drafts:`) is the same loop over a list of drafts, each its own engine:
the target runs once per micro-batch outside them (forward_drafts), one save commits them all.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from omegaconf import DictConfig

from specdraft.config import draft_names, draft_view, save_config
from specdraft.data.sampler import ShardedBatchSampler
from specdraft.drafts.base import CaptureRequest, DraftLoss, HostBatch
from specdraft.drafts.registry import build_draft
from specdraft.rundir.ownership import claim_run_dir, start_run_dir
from specdraft.parallel.sequence import SequenceParallel, sequence_parallel_groups
from specdraft.target.light import load_light_target
from specdraft.target.checks import load_target_config
from specdraft.target.model import load_frozen_target, load_target_tokenizer
from specdraft.rundir.layout import config_file, draft_part, export_dir
from specdraft.checkpoint.manager import CheckpointManager, DraftPart
from specdraft.parallel.collectives import run_shared
from specdraft.parallel.zero import gather_draft_state_dict
from specdraft.train.engine import build_engine, draft_parameter_count, init_distributed, resolve_target_placement
from specdraft.export.files import BackgroundExporter, serving_formats, write_draft_export
from specdraft.export.init_from import apply_import, planned_import
from specdraft.train.interrupt import StopSignals, TrainingInterrupted
from specdraft.train.data import prepare_data
from specdraft.train.features import open_run_cache
from specdraft.train.evals import load_eval_prompts, measure_draft_tau
from specdraft.train.metrics import LossWindow, MetricsLogger
from specdraft.train.memory import estimate_run_peak
from specdraft.train.model import DraftWithLoss, TargetWithDraft, target_features
from specdraft.errors import SpecdraftError
from specdraft.transfer import to_device


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    samples_seen: int = 0  # sequences consumed, all ranks
    tokens_seen: int = 0  # tokens fed to the target, all ranks


@dataclass
class TrainResult:
    steps: int
    losses: List[float] = field(default_factory=list)  # per optimizer step, mean over ranks (read at log time)
    draft_losses: Dict[str, List[float]] = field(default_factory=dict)  # the same per draft of a `drafts:` run
    # per draft (None: a one-draft run): (first step, last step, loss) of each logging window, the
    # progress bar's `loss=`, token-weighted over the window; the summary line reads the same ones
    window_losses: Dict[Optional[str], List[Tuple[int, int, float]]] = field(default_factory=dict)
    tokens_per_second: float = 0.0
    export_dir: Optional[Path] = None
    run_dir: Optional[Path] = None


def train(cfg: DictConfig, log=print) -> TrainResult:
    rank, world_size = init_distributed()
    sequence_parallel = sequence_parallel_groups(cfg.sequence_parallel_size)  # collective
    stop = StopSignals(rank)
    # a failure closes the progress bar (its line ends before the error's); the caller's signal
    # handlers come back whatever happens (train() runs in-process too: tests, notebooks)
    with contextlib.ExitStack() as closing:
        closing.callback(stop.restore)
        return _train(cfg, rank, world_size, log if rank == 0 else (lambda *_: None), closing, stop, sequence_parallel)


def _train(
    cfg: DictConfig,
    rank: int,
    world_size: int,
    log,
    closing: contextlib.ExitStack,
    stop: StopSignals,
    sp: SequenceParallel,
) -> TrainResult:
    from tqdm import tqdm

    # -- setup -------------------------------------------------------------------------------
    seed_everything(cfg.seed)
    run_dir = Path(cfg.output_dir)
    checkpoints = CheckpointManager(run_dir, cfg, rank, world_size)
    # A bad `resume:` fails before anything is written. The plan may change
    # gradient_accumulation_steps: the global batch is the checkpoint's.
    plan = checkpoints.plan_resume(log)
    # draft.init_from is read and checked now, before anything is written; never on a resume
    imports = {
        name: planned_import(draft_view(cfg, name), resuming=plan is not None, log=log) for name in draft_names(cfg)
    }
    # Before anything is loaded: output_dir is new, empty or this run's, and takes files.
    run_shared(lambda: claim_run_dir(run_dir, str(cfg.resume)))
    tokenizer = load_target_tokenizer(cfg.target)
    data = prepare_data(cfg, tokenizer, rank, log)
    # the ranks of one SP group read the same batches: batches are dealt to data-parallel ranks
    data_rank, data_world = sp.data_rank, sp.data_world
    sampler = ShardedBatchSampler(
        len(data), cfg.per_device_batch_size, data_rank, data_world, cfg.seed, cfg.gradient_accumulation_steps
    )
    total_steps = planned_steps(cfg, sampler)

    run_cache = None
    if cfg.feature_cache is not None:  # refused before anything is built when it cannot serve the run
        run_cache = open_run_cache(cfg, tokenizer, data, load_target_config(cfg.target), rank, log)
        if run_cache.offline and cfg.eval_steps > 0 and cfg.eval_prompts:
            raise SpecdraftError(
                "key 'eval_steps': offline training builds none of the target's layers to decode with; "
                "set eval_steps: -1 (and `specdraft eval` the exports), or feature_cache_mode: hybrid"
            )
    if run_cache is not None and run_cache.offline:  # its embeddings and lm_head, never a layer
        target = load_light_target(cfg.target, cfg.precision)
    else:
        target = load_frozen_target(cfg.target, cfg.precision)
    placement = resolve_target_placement(cfg, target.config, world_size)
    trainees = [
        build_trainee(cfg, name, target, data, imports[name], plan, placement, total_steps, log, sp)
        for name in draft_names(cfg)
    ]
    several = trainees[0].name is not None
    if several:  # outside every engine: placed as an engine places its module
        target.to(trainees[0].engine.device)
    elif run_cache is not None and run_cache.hybrid:  # a live pass's features: rounded, committed
        trainees[0].engine.module.round_live = run_cache.on_live
    state = TrainState()
    if plan is not None:
        restored = checkpoints.resume([DraftPart(t.name, t.engine) for t in trainees], plan, log)
        state = TrainState(**restored["train_state"])
        sampler.load_state_dict(restored["sampler"])
        log(f"resumed from {plan.slot} at step {state.step}")

    def write_config():
        start_run_dir(run_dir)
        save_config(cfg, config_file(run_dir))

    run_shared(write_config)
    checkpoints.check_shared()
    for t in trainees:
        if t.draft.describe():
            log(f"specdraft: {t.label}: {t.draft.describe()}")
    drafts = ", ".join(
        f"{t.label}, {draft_parameter_count(t.engine.module) / 1e6:.2f}M trainable params" for t in trainees
    )
    if several:  # what the memory model counts: one target, every draft, the union of their captures
        peak = estimate_run_peak(target.config, cfg, world_size, placement).total
        drafts = f"{len(trainees)} drafts from one target pass ({drafts}; ~{peak / 2**30:.2f} GiB per device)"
    log(
        f"specdraft: {drafts}, "
        f"{len(data)} sequences x {cfg.max_seq_length} tokens, {total_steps} steps, "
        f"ZeRO-{cfg.zero_stage}{f' (target {placement})' if cfg.zero_stage == 3 else ''}, {cfg.precision}, "
        f"{world_size} rank(s){f', {sp.size} per sequence' if sp.size > 1 else ''}"
    )

    metrics = run_shared(lambda: MetricsLogger(run_dir, cfg, enabled=rank == 0), on_rank=None)

    def log_metrics(step: int, values: dict) -> None:  # rank 0 writes; its failure stops every rank
        run_shared(lambda: metrics.log(step, values))

    eval_prompts = load_eval_prompts(cfg, tokenizer)
    progress = closing.enter_context(
        tqdm(total=total_steps, initial=state.step, disable=rank != 0, desc="train", unit="step")
    )
    result = TrainResult(steps=total_steps, run_dir=run_dir)
    exporter = BackgroundExporter()
    started = time.perf_counter()
    start_step = state.step
    stop.install()  # from here SIGINT / SIGTERM stop at a step boundary, after a save

    # -- loop --------------------------------------------------------------------------------
    while state.step < total_steps:
        for micro in range(cfg.gradient_accumulation_steps):
            indices = sampler.next_batch()
            batch = model_inputs(data.batch(indices), cfg.document_mask)
            cached = run_cache.batch(indices) if run_cache is not None else None
            options = [
                t.draft.sample_batch_options(
                    batch_generator(cfg.seed, state.step, micro * data_world + data_rank), cfg.max_seq_length
                )
                for t in trainees
            ]
            if several:
                live = run_cache.on_live if run_cache is not None and cached is None else None
                outs = forward_drafts(target, [t.engine for t in trainees], batch, options, sp, cached, live)
            else:
                outs = [forward_step(trainees[0].engine, batch, options[0], cached)]
            for t, out in zip(trainees, outs):
                t.window.add(out)
            state.samples_seen += cfg.per_device_batch_size * data_world
            state.tokens_seen += batch["input_ids"].numel() * data_world
        state.step += 1
        for t in trainees:
            t.window.end_step()
        progress.update(1)
        last = state.step == total_steps
        stop_signal = stop.agreed()  # collective: every rank stops after the same step

        if state.step % cfg.logging_steps == 0 or last or stop_signal:
            elapsed = time.perf_counter() - started
            values = {}
            for t in trainees:
                step_losses, own = t.window.reduce()  # the loop's one host sync per draft and log interval
                (result.losses if t.name is None else result.draft_losses.setdefault(t.name, [])).extend(step_losses)
                result.window_losses.setdefault(t.name, []).append(
                    (state.step - len(step_losses) + 1, state.step, own["loss"])
                )
                own.update(lr=t.engine.lr_scheduler.lr_of_last_update())
                values.update(t.prefixed(own))
            values.update(
                tokens_per_s=_rate(state, start_step, cfg, data_world, elapsed), samples_seen=state.samples_seen
            )
            log_metrics(state.step, values)
            if several:
                progress.set_postfix({t.name: f"{values[t.name + '/loss']:.3f}" for t in trainees})
            else:
                progress.set_postfix(loss=f"{values['loss']:.3f}", acc=f"{values['accuracy']:.3f}")

        if eval_prompts and (state.step % cfg.eval_steps == 0 or last) and not stop_signal:
            for t in trainees:
                tau = measure_draft_tau(t.engine, target, tokenizer, eval_prompts, cfg.eval_temperature, cfg.seed)
                log_metrics(state.step, t.prefixed(tau))
                log(
                    f"step {state.step}: {'' if t.name is None else t.name + ' '}tau {tau['eval/tau']:.2f} "
                    f"on {len(eval_prompts)} held-out prompts"
                )

        if state.step % cfg.save_steps == 0 or last or stop_signal:
            run_shared(exporter.wait)  # the previous export's failure (rank 0) stops every rank here
            # rank 0; CPU copies, safe to write later
            parts = [DraftPart(t.name, t.engine, gather_draft_state_dict(t.engine)) for t in trainees]
            client_state = {"train_state": asdict(state), "sampler": sampler.state_dict()}
            slot = checkpoints.save(parts, state.step, client_state)  # one slot, one commit for every draft
            result.export_dir = export_dir(run_dir, state.step)
            if rank == 0:  # written on the export thread, off the training path
                exporter.submit(write_exports, result.export_dir, parts, trainees, tokenizer, run_dir, state.step)
        if stop_signal:
            break

    # -- summary -----------------------------------------------------------------------------
    run_shared(exporter.close)  # the last export is on disk before train() returns
    if run_cache is not None:
        run_cache.close()  # hybrid: the rows computed since the last shard, committed
    progress.close()
    run_shared(metrics.close)
    if state.step < total_steps:  # stopped by a signal, its step committed and exported
        interrupted = TrainingInterrupted(stop_signal, state.step, slot.name)
        log(str(interrupted))
        raise interrupted
    elapsed = time.perf_counter() - started
    result.tokens_per_second = _rate(state, start_step, cfg, data_world, elapsed)
    if result.losses:
        log(
            f"done: {state.step} steps, loss {_first_and_last(result.window_losses[None])}, "
            f"{result.tokens_per_second:,.0f} tokens/s, draft written to {result.export_dir}"
        )
    elif result.draft_losses:
        losses = ", ".join(f"{name} {_first_and_last(result.window_losses[name])}" for name in result.draft_losses)
        log(
            f"done: {state.step} steps, loss {losses}, {result.tokens_per_second:,.0f} tokens/s, drafts written "
            f"to {result.export_dir}/<name>/"
        )
    else:  # resumed a finished run: say so instead of silently doing nothing
        result.export_dir = export_dir(run_dir, state.step)
        log(
            f"done: the run in {run_dir} had already reached step {state.step} of {total_steps}; "
            f"its draft is in {result.export_dir} (another output_dir trains anew)"
        )
    return result


@dataclass
class Trainee:
    """One draft of the run and its engine. name None: a one-draft run (its files as ever)."""

    name: Optional[str]
    cfg: DictConfig  # the run as this draft alone would be configured (config.draft_view)
    engine: Any
    window: LossWindow = field(default_factory=LossWindow)

    @property
    def draft(self):
        return self.engine.module.draft_model

    @property
    def label(self) -> str:
        family = f"{self.cfg.draft.type} draft"
        return family if self.name is None else f"{self.name} ({family})"

    def prefixed(self, values: dict) -> dict:
        """Metric names of this draft: as they are for a one-draft run, `<name>/...` otherwise."""
        return values if self.name is None else {f"{self.name}/{key}": value for key, value in values.items()}


def build_trainee(
    cfg: DictConfig,
    name: Optional[str],
    target,
    data,
    imported,
    plan,
    placement: str,
    total_steps: int,
    log,
    sp: SequenceParallel = SequenceParallel(),
) -> Trainee:
    """Draft `name` of the run and its engine. A one-draft run's engine holds the target beside the
    draft (TargetWithDraft); a draft of several runs outside it (DraftWithLoss)."""
    view = draft_view(cfg, name)
    # A resumed draft takes its state besides the weights (EAGLE-3's vocab maps) from the slot's
    # frozen-state file (CheckpointManager.resume), an imported one from its files: neither is
    # derived from the data.
    draft = build_draft(view.draft, target.config, data=None if plan is not None or imported else data)
    if imported is not None:
        apply_import(draft, imported, data, log)
    # draft.lm_head of EAGLE-3 / P-EAGLE: started from (fresh) or frozen at the target's rows
    draft.adopt_target_weights(target.lm_head.weight, fresh=plan is None and imported is None)
    serving_formats(draft, view)  # a format named in the config that cannot serve this draft: refused now
    if name is None:
        model = TargetWithDraft(target, draft, cfg.loss_chunk_size, sp)
    else:
        model = DraftWithLoss(draft, cfg.loss_chunk_size)
    engine = build_engine(view, model, total_steps, placement, load_universal=plan is not None and plan.universal)
    return Trainee(name, view, engine)


def write_exports(
    out_dir: Path, parts: List[DraftPart], trainees: List[Trainee], tokenizer, run_dir: Path, step: int
) -> None:
    """Rank 0, on the export thread: each draft's export (a draft of several in out_dir/<name>/)."""
    for part, t in zip(parts, trainees):
        write_draft_export(
            draft_part(out_dir, t.name), part.weights, t.draft, t.cfg, tokenizer, run_dir=run_dir, step=step
        )


def forward_step(engine, batch: dict, options: dict, cached: Optional[dict] = None) -> DraftLoss:
    """One micro-batch: forward (target under no_grad inside), backward, step (DeepSpeed only
    updates at the gradient-accumulation boundary). cached: its features from a feature cache."""
    inputs, host = device_inputs(batch, engine.device), host_batch(batch)
    if cached is not None:
        options = dict(options, cached={key: to_device(value, engine.device) for key, value in cached.items()})
    out: DraftLoss = engine(**inputs, host=host, **options)
    engine.backward(out.loss)
    engine.step()
    return out


def forward_drafts(
    target,
    engines: list,
    batch: dict,
    options: List[dict],
    sp: SequenceParallel = SequenceParallel(),
    cached: Optional[dict] = None,
    live=None,
) -> List[DraftLoss]:
    """Several drafts, one target pass: the target captures the union of the drafts' requests
    once (no_grad), then each draft reads its part: forward, backward, step on its own engine.
    cached: the batch's features from a feature cache instead of the pass; live (hybrid): what a
    live pass's features become (committed to the cache, rounded as it stores them)."""
    device = engines[0].device
    inputs, host = device_inputs(batch, device), host_batch(batch)
    request = functools.reduce(CaptureRequest.merged, [e.module.draft_model.capture_request() for e in engines])
    # a draft that moves the target's positions (GLIDE's anchor_offset) is alone in its run (config
    # check): its positions are the target pass's, as in forward_step
    moved = [own["position_ids"] for own in options if "position_ids" in own]
    features = target_features(
        target.model,
        request,
        inputs["input_ids"],
        inputs.get("document_positions"),
        inputs.get("document_ids"),
        position_ids=moved[0] if moved else None,
        shard=sp.shard(inputs["input_ids"].shape[1]),
        cached=None if cached is None else {key: to_device(value, device) for key, value in cached.items()},
        target_config=target.config,
    )
    if live is not None:
        features = live(features)
    outs = []
    for engine, own in zip(engines, options):
        out: DraftLoss = engine(
            features,
            target.lm_head.weight,
            inputs["input_ids"],
            inputs["loss_mask"],
            inputs.get("document_ids"),
            host=host,
            **own,
        )
        engine.backward(out.loss)
        engine.step()
        outs.append(out)
    return outs


# -- helpers -----------------------------------------------------------------------------------


HOST_ONLY = "token_mask"  # in model_inputs for the HostBatch, never sent to the device


def device_inputs(batch: dict, device) -> dict:
    """model_inputs' tensors the model reads, copied to `device` (pinned, asynchronous)."""
    return {key: to_device(value, device) for key, value in batch.items() if key != HOST_ONLY}


def host_batch(batch: dict) -> HostBatch:
    """model_inputs' host tensors a loss picks its counted rows from."""
    return HostBatch(batch["input_ids"], batch["loss_mask"], batch.get("document_ids"), batch.get(HOST_ONLY))


def model_inputs(batch: dict, document_mask: bool) -> dict:
    """What the model reads of a packed batch. document_mask: per-document positions and
    attention inside documents; a batch without any border goes without (the fast causal path).
    Off: the window is one stream, positions 0..T-1 across conversation borders."""
    inputs = {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"]}
    if document_mask:
        inputs["document_positions"] = batch["document_positions"]
        if bool((batch["document_ids"] != 0).any()):  # on the host: no device sync
            inputs["document_ids"] = batch["document_ids"]
    if HOST_ONLY in batch and not bool(batch[HOST_ONLY].all()):  # padding: read on the host only
        inputs[HOST_ONLY] = batch[HOST_ONLY]
    return inputs


def planned_steps(cfg: DictConfig, sampler: ShardedBatchSampler) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, cfg.num_train_epochs * sampler.steps_per_epoch)


def batch_generator(seed: int, step: int, micro_batch: int) -> torch.Generator:
    """Per-batch randomness (lag, position offsets) from a pure function of where we are: nothing
    to save for exact resume. micro_batch = micro_step x world_size + rank, the sampler's index of
    the micro-batch within the step, so a batch draws the same options at any world size."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 10_007 + micro_batch)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _first_and_last(windows: List[Tuple[int, int, float]]) -> str:
    """`5.123 (steps 1-10) -> 2.400 (steps 291-300)`: the progress bar's first and last `loss=`."""

    def one(first: int, last: int, loss: float) -> str:
        return f"{loss:.3f} (step{'s' if last > first else ''} {first}{f'-{last}' if last > first else ''})"

    return f"{one(*windows[0])} -> {one(*windows[-1])}"


def _rate(state: TrainState, start_step: int, cfg: DictConfig, world_size: int, elapsed: float) -> float:
    steps = state.step - start_step
    tokens = steps * cfg.gradient_accumulation_steps * cfg.per_device_batch_size * cfg.max_seq_length * world_size
    return tokens / max(elapsed, 1e-9)
