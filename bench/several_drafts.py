"""Several drafts from one target pass against each draft trained alone, measured in one process
on the same batches:

    together   one training step of a run of several drafts (`drafts:`): the target once on the
               union of the drafts' capture requests, then each draft's forward, backward and
               optimizer step on its own DeepSpeed engine (train/loop.py's forward_drafts)
    alone_i    the training step of draft i's own run (train/loop.py's forward_step)
    (a)        the target forward under no_grad as plain transformers runs it (+ lm_head when an
               objective reads the target's distribution), as bench/step_efficiency.py's (a)
    (b_i)      draft i's forward + backward given the target's outputs (a plain copy, no engine)

    ratio      = together / sum_i alone_i       what one run costs against the runs alone
    step_ratio = together / ((a) + sum_i (b_i))  how close the shared step is to its floor
    target share of a solo step = capture_i / alone_i, where capture_i is the target pass draft
               i's own run makes (its request only): the part of a solo step that is shared

Medians of several rounds after warm-up; each round runs every measurement on the same batch, in
an order rotated round by round, so load from other processes falls on all alike. Times are CPU
seconds of this 1-thread process (bench/step_efficiency.py's timed()).

    OMP_NUM_THREADS=1 python bench/several_drafts.py [--families glide,eagle3,dspark]
        [--shapes bench,deep] [--zero 2] [--rounds 3] [--warmup 1]

Shapes: "bench" is the bench preset's target (Llama, 6 layers, hidden 256, vocab 4096) at 1 x 2048;
"deep" the same layers 48 deep at 1 x 2048 (a target whose forward is most of a solo step); "tiny"
only keeps the script from rotting. Drafts: the demo configs' settings (step_efficiency's
FAMILY_SETTINGS). The last line: `ratio=<x> step_ratio=<y> target_share=<z>` of the last shape,
target_share the smallest over the families.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from step_efficiency import (
    FAMILY_SETTINGS,
    SHAPES as STEP_SHAPES,
    model_capture,
    packed_data,  # noqa: E402
    preset_shape,
    random_target,
    run_config,
    timed,
)
from specdraft.drafts.base import LossBatch
from specdraft.data.sampler import ShardedBatchSampler  # noqa: E402
from specdraft.drafts.registry import build_draft  # noqa: E402
from specdraft.target.attention import document_attention  # noqa: E402
from specdraft.target.capture import CaptureRequest, capture  # noqa: E402
from specdraft.train import loop  # noqa: E402
from specdraft.train.engine import build_engine, init_distributed  # noqa: E402
from specdraft.train.model import DraftWithLoss, TargetWithDraft  # noqa: E402

BENCH = preset_shape("bench", "bench", batch=1, seq=2048, window=512)
SHAPES = {"tiny": STEP_SHAPES["tiny"], "bench": BENCH, "deep": dataclasses.replace(BENCH, name="deep", layers=48)}


class SeveralBench:
    """The shared target; per family a run alone (its engine), a draft of the run together (its
    engine) and a plain copy for (b)."""

    def __init__(self, shape, families: Sequence[str], zero_stage: int, data):
        self.shape, self.families, self.data = shape, list(families), data
        self.target = random_target(shape)  # one target for every engine: frozen, never written
        self.cfgs = {f: run_config(shape, zero_stage, True, f) for f in families}
        self.alone, self.together, self.plain = {}, {}, {}
        for family, cfg in self.cfgs.items():
            draft = build_draft(cfg.draft, self.target.config)  # seeded: the same init each time
            self.plain[family] = copy.deepcopy(draft)
            self.alone[family] = build_engine(cfg, TargetWithDraft(self.target, draft, cfg.loss_chunk_size), 1000)
            together = build_draft(cfg.draft, self.target.config)
            self.together[family] = build_engine(cfg, DraftWithLoss(together, cfg.loss_chunk_size), 1000)
        # (a) reads lm_head when any objective reads the target's distribution
        self.reads_distribution = any(self.plain[f].objective.needs_teacher for f in families)
        self.sampler = ShardedBatchSampler(len(data), shape.batch, rank=0, world_size=1, seed=0)

    def target_forward(self, ids, positions, documents) -> None:
        with torch.no_grad():  # the capture's attention: inside each document, no (T, T) mask
            hidden = capture(
                self.target.model, ids, positions, CaptureRequest(final_hidden=True), document_attention(documents)
            ).final_hidden
            if self.reads_distribution:
                self.target.lm_head(hidden)

    def draft_step(self, family, features, batch, options) -> None:
        draft = self.plain[family]
        out = draft.training_loss(
            LossBatch(
                features,
                self.target.lm_head.weight,
                batch["input_ids"],
                batch["loss_mask"],
                self.cfgs[family].loss_chunk_size,
                documents=batch.get("document_ids"),
                options=options,
            )
        )
        out.loss.backward()
        draft.zero_grad(set_to_none=False)  # grads stay allocated, as in the engine

    def round(self, step: int) -> dict:
        shape = self.shape
        batch = loop.model_inputs(self.data.batch(self.sampler.next_batch()), True)
        ids, documents = batch["input_ids"], batch.get("document_ids")
        positions = batch.get("document_positions", torch.arange(shape.seq).expand(shape.batch, shape.seq))
        options = {
            f: self.plain[f].sample_batch_options(loop.batch_generator(0, step, 0), shape.seq) for f in self.families
        }
        jobs = {
            "together": lambda: loop.forward_drafts(
                self.target, list(self.together.values()), batch, [options[f] for f in self.families]
            ),
            "a": lambda: self.target_forward(ids, positions, documents),
        }
        for f in self.families:
            features = model_capture(self.alone[f].module, ids, positions, documents)  # (b)'s input, untimed
            jobs[f"alone_{f}"] = lambda f=f: loop.forward_step(self.alone[f], batch, options[f])
            jobs[f"capture_{f}"] = lambda f=f: model_capture(self.alone[f].module, ids, positions, documents)
            jobs[f"b_{f}"] = lambda f=f, features=features: self.draft_step(f, features, batch, options[f])
        names = list(jobs)
        turn = step % len(names)
        return {name: timed(jobs[name]) for name in [*names[turn:], *names[:turn]]}


def measure(shape, families, zero_stage: int, rounds: int, warmup: int, work: Path) -> dict:
    data = packed_data(shape, rows=shape.batch * (rounds + warmup), out=work / f"{shape.name}-{zero_stage}")
    bench = SeveralBench(shape, families, zero_stage, data)
    samples = [bench.round(step) for step in range(rounds + warmup)][warmup:]
    m = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    alone = sum(m[f"alone_{f}"] for f in families)
    return {
        "medians": m,
        "ratio": m["together"] / alone,
        "step_ratio": m["together"] / (m["a"] + sum(m[f"b_{f}"] for f in families)),
        "share": {f: m[f"capture_{f}"] / m[f"alone_{f}"] for f in families},
        "alone": alone,
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="glide,eagle3,dspark")
    parser.add_argument("--shapes", default="bench,deep")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",")]
    unknown = [f for f in families if f not in FAMILY_SETTINGS]
    if unknown or len(families) < 2:
        parser.error(f"--families: two or more of {', '.join(FAMILY_SETTINGS)}")
    init_distributed()
    work = Path(tempfile.mkdtemp(prefix="specdraft-bench-several-"))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), ZeRO-{args.zero}; CPU ms per step "
        f"(medians of {args.rounds} rounds); drafts: {', '.join(families)}"
    )
    result = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        r = measure(shape, families, args.zero, args.rounds, args.warmup, work)
        m = r["medians"]
        print(
            f"{name}: target {shape.layers} layers x hidden {shape.hidden}, vocab {shape.vocab}, "
            f"{shape.batch} x {shape.seq} tokens"
        )
        print(f"  {'draft':<8}{'alone ms':>10}{'capture ms':>12}{'target share':>14}{'(b) ms':>10}")
        for f in families:
            print(
                f"  {f:<8}{m[f'alone_{f}'] * 1e3:10.1f}{m[f'capture_{f}'] * 1e3:12.1f}{r['share'][f]:14.2f}"
                f"{m[f'b_{f}'] * 1e3:10.1f}"
            )
        print(
            f"  together {m['together'] * 1e3:.1f} ms, sum alone {r['alone'] * 1e3:.1f} ms, (a) {m['a'] * 1e3:.1f} ms: "
            f"ratio {r['ratio']:.3f}, step ratio {r['step_ratio']:.3f}",
            flush=True,
        )
        result = r
    print(
        f"ratio={result['ratio']:.3f} step_ratio={result['step_ratio']:.3f} "
        f"target_share={min(result['share'].values()):.3f}"
    )
    return result


if __name__ == "__main__":
    main()
