"""How close a training step is to its floor, measured in one run on the same batches:

    (a) the target forward under no_grad, as plain transformers runs it: the decoder stack
        `model.model` (plus `lm_head` only when the draft's objective reads the target's
        distribution; the output says which), attending inside each packed document (the
        (B, 1, T, T) mask the capture gives it too);
    (b) the draft forward + backward, given the target's outputs (a plain copy of the draft, no
        DeepSpeed hooks);
    (c) the whole training step through the DeepSpeed engine, as train() runs it: batch read from
        the packed memory-mapped data, per-batch options, capture, loss, backward, optimizer step.

    ratio = median(c) / (median(a) + median(b))       medians of several rounds after warm-up

Each round times (a), (b), (c) back to back on the same batch, so load from other processes
falls on all three alike; the times are CPU seconds of the process (see timed()). Also printed: the capture alone (what (c) spends in the target).

    OMP_NUM_THREADS=1 python bench/step_efficiency.py [--families glide,eagle3,dflash,dspark]
        [--shapes demo,long,large] [--zero 0,2] [--rounds 5]
        [--objectives ce,"0.9*tv + 0.1*ce",kl:all] [--distill-temperature 1.0]

--families: each family with its own default objective (GLIDE ce, EAGLE-3 soft_ce, DFlash ce,
DSpark 0.9 tv + 0.1 ce) and the demo configs' draft settings (EAGLE-3: 7 TTT steps; DFlash: 2
layers, blocks of 8, 64 anchors per 256 tokens; DSpark: DFlash's and Markov rank 64). The
per-family ratios print as `ratio_<family>=`.

--objectives adds GLIDE steps with distillation objectives (`draft.loss`): each gets its own
target, draft and engine (the same seeded weights), and in every round each objective's (a), (b),
(c) run on the same batch, the objectives in an order rotated round by round. For them (a)
includes lm_head (the teacher's logits, every position; printed apart as 'lm_head ms'), the
capture keeps the final hidden state (every layer runs to its end), and (b) includes the loss's
own teacher matmul on the counted positions: the second vocab-sized matmul per token. So the
floor (a) + (b) counts the teacher logits twice over (all rows in (a), counted rows in (b)); subtract
'lm_head ms' from (a) for the tighter floor. Also printed per objective: c/c_ce and b/b_ce, its
(c) and (b) over the CE step's. CE is always measured and gives `ratio=` as without the option.
'SPEC:all' trains with draft.distill_tokens: all (the teacher terms on prompt tokens too; the
bench's conversations are one third prompt).

Shapes: "demo" is the demo target (specdraft.demo preset "demo": Llama, 4 layers, hidden 256,
vocab 4096) at batch 8 x 256; "long" the same target at batch 1 x 4096; "large" is a random Llama
of 8 layers, hidden 512, vocab 32000 at batch 2 x 1024; "tiny" (the test preset's target at 2 x 64)
only keeps the script from rotting. The last line, `ratio=<x>`, is the last shape's worst ratio
over the ZeRO stages and families (of each family's default objective); with distillation objectives it adds `distill_ratio=`, `distill_step_ratio=`
(c/c_ce) and `distill_draft_ratio=` (b/b_ce), each the larger shape's worst over stages and objectives.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

warnings.filterwarnings("ignore")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from specdraft.drafts.base import LossBatch
from specdraft.config import TrainConfig  # noqa: E402
from specdraft.data.packing import open_packed_cache  # noqa: E402
from specdraft.data.sampler import ShardedBatchSampler  # noqa: E402
from specdraft.demo.presets import get_preset  # noqa: E402
from specdraft.drafts import family_keys  # noqa: E402
from specdraft.drafts.registry import FAMILIES, build_draft  # noqa: E402
from specdraft.target.attention import document_attention  # noqa: E402
from specdraft.drafts.objectives import CE  # noqa: E402
from specdraft.drafts.objective_options import parse_objective  # noqa: E402
from specdraft.target.capture import CaptureRequest, capture  # noqa: E402
from specdraft.train import loop  # noqa: E402
from specdraft.train.engine import build_engine, init_distributed  # noqa: E402
from specdraft.train.model import TargetWithDraft  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int
    window: int  # the draft's sliding window (the demo config's 128, LongSpec's 512)


def preset_shape(name: str, preset: str, batch: int, seq: int, window: int) -> Shape:
    p = get_preset(preset)
    return Shape(
        name,
        p.num_hidden_layers,
        p.hidden_size,
        p.num_attention_heads,
        p.num_key_value_heads,
        p.intermediate_size,
        p.vocab_size,
        batch=batch,
        seq=seq,
        window=window,
    )


SHAPES = {
    "tiny": preset_shape("tiny", "tiny", batch=2, seq=64, window=32),
    "demo": preset_shape("demo", "demo", batch=8, seq=256, window=128),
    "long": preset_shape("long", "demo", batch=1, seq=4096, window=512),
    "large": Shape(
        "large",
        layers=8,
        hidden=512,
        heads=8,
        kv_heads=4,
        intermediate=1376,
        vocab=32000,
        batch=2,
        seq=1024,
        window=512,
    ),
}


def random_target(shape: Shape, family: str = "glide"):
    """A seeded random Llama of the shape; for a family that drafts only for qwen3_next targets
    (MTP), a qwen3_next of the same dims (every layer full attention, 8 experts, top 2)."""
    if "llama" not in (FAMILIES[family].target_model_types or ("llama",)):
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            vocab_size=shape.vocab,
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers,
            layer_types=["full_attention"] * shape.layers,
            num_attention_heads=shape.heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.hidden // shape.heads,
            num_experts=8,
            num_experts_per_tok=2,
            # multiples of 16: torch's grouped_mm (transformers' MoE default) needs
            # 16-byte strides
            moe_intermediate_size=shape.intermediate // 64 * 16,
            shared_expert_intermediate_size=shape.intermediate // 32 * 16,
            max_position_embeddings=4 * shape.seq + 64,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        return Qwen3NextForCausalLM(config).eval().requires_grad_(False)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=4 * shape.seq + 64,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.eval()
    model.requires_grad_(False)
    return model


def packed_data(shape: Shape, rows: int, out: Path):
    """A packed cache as prepare_data leaves it: random tokens in conversations of 64-512 tokens
    (the first third a prompt, the rest the answer: the loss mask), cut into windows."""
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    count = rows * shape.seq
    tokens = rng.integers(0, shape.vocab, size=count, dtype=np.uint32)
    mask = np.zeros(count, dtype=np.uint8)
    starts = np.zeros(count, dtype=np.uint8)
    start = 0
    while start < count:
        length = int(rng.integers(min(64, shape.seq // 2), min(513, shape.seq + 1)))
        starts[start] = 1
        mask[start + length // 3 : start + length] = 1
        start += length
    tokens.tofile(out / "tokens.bin")
    mask.tofile(out / "loss_mask.bin")
    starts.tofile(out / "doc_start.bin")
    (out / "meta.json").write_text(json.dumps({"sequences": rows, "max_seq_length": shape.seq}))
    return open_packed_cache(out)


FAMILY_SETTINGS = {  # the demo configs' draft keys (configs/demo-*.yaml), per family
    "glide": lambda shape: {"sliding_window": shape.window},
    "eagle3": lambda shape: {"ttt_steps": 7},
    "dflash": lambda shape: {"num_layers": 2, "block_size": 8, "max_anchors": max(1, shape.seq // 4)},
    "dspark": lambda shape: {
        "num_layers": 2,
        "block_size": 8,
        "max_anchors": max(1, shape.seq // 4),
        "markov_rank": 64,
    },
    "dflash2": lambda shape: {
        "num_layers": 2,
        "block_size": 8,
        "max_anchors": max(1, shape.seq // 4),
        "selector_rank": 64,
        "selector_top_k": 8,
    },
    "mtp": lambda shape: {"num_speculative_steps": 3},  # configs/demo-mtp.yaml (speculators' default)
    "peagle": lambda shape: {"num_depths": 8, "mask_token_id": 0},
}


def run_config(shape: Shape, zero_stage: int, document_mask: bool, family: str = "glide"):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.document_mask = document_mask
    cfg.max_seq_length = shape.seq
    cfg.per_device_batch_size = shape.batch
    cfg.zero_stage = zero_stage
    cfg.draft.type = family
    for key, value in FAMILY_SETTINGS[family](shape).items():
        cfg.draft[key] = value
    return cfg


def timed(fn) -> float:
    """CPU seconds of this process (all its threads). Wall time on this shared 2-core machine
    swings with other processes' load; CPU time of a 1-thread process does not, and on an idle
    machine the two agree. On a GPU, use wall time with a synchronize instead."""
    start = time.process_time()
    fn()
    return time.process_time() - start


class StepBench:
    """One objective's target, draft, engine and batch streams; round() times (a), (b), (c) once."""

    def __init__(
        self,
        shape: Shape,
        zero_stage: int,
        document_mask: bool,
        spec: Optional[str],
        temperature: float,
        data,
        family: str = "glide",
    ):
        cfg = run_config(shape, zero_stage, document_mask, family)
        self.family = family
        if spec is not None:  # None: the family's default objective (GLIDE: ce), as before
            loss, _, tokens = spec.partition(":")  # 'kl:all': draft.distill_tokens=all
            cfg.draft.loss = loss
            cfg.draft.distill_temperature = temperature
            cfg.draft.distill_tokens = tokens or "answers"
        self.shape, self.cfg, self.data, self.spec = shape, cfg, data, spec
        self.target = random_target(shape, family)  # seeded: every objective gets the same target and draft
        draft = build_draft(cfg.draft, self.target.config)
        self.plain_draft = copy.deepcopy(draft)  # (b) runs outside the engine: no ZeRO hooks on its grads
        self.model = TargetWithDraft(self.target, draft, cfg.loss_chunk_size)
        self.engine = build_engine(cfg, self.model, total_steps=1000)
        self.objective = getattr(draft, "objective", CE)  # a family without draft.loss (MTP) trains CE
        # GLIDE's hard-label CE never reads the target's softmax; a distillation objective does
        self.reads_distribution = self.objective.needs_teacher
        self.sampler = ShardedBatchSampler(len(data), shape.batch, rank=0, world_size=1, seed=0)
        self.peek = ShardedBatchSampler(len(data), shape.batch, rank=0, world_size=1, seed=0)  # (c)'s, ahead

    def target_forward(self, ids, positions, documents) -> float:
        """(a); returns the CPU seconds of its lm_head part (0 without)."""
        # The attention the step needs: inside each document. Given positions alone, transformers 5
        # with SDPA does not infer the borders: it runs is_causal over the whole row, which costs
        # half of the masked attention at 4k tokens and is not the forward training needs.
        with torch.no_grad():  # the capture's attention: inside each document, no (T, T) mask
            hidden = capture(
                self.target.model, ids, positions, CaptureRequest(final_hidden=True), document_attention(documents)
            ).final_hidden
            if self.reads_distribution:
                return timed(lambda: self.target.lm_head(hidden))
        return 0.0

    def draft_step(self, features, ids, loss_mask, documents, options):
        out = self.plain_draft.training_loss(
            LossBatch(
                features,
                self.target.lm_head.weight,
                ids,
                loss_mask,
                self.cfg.loss_chunk_size,
                documents=documents,
                options=options,
            )
        )
        out.loss.backward()
        self.plain_draft.zero_grad(set_to_none=False)  # grads stay allocated, as in the engine

    def engine_step(self, step):
        batch = loop.model_inputs(self.data.batch(self.sampler.next_batch()), self.cfg.document_mask)
        options = self.engine.module.draft_model.sample_batch_options(loop.batch_generator(0, step, 0), self.shape.seq)
        loop.forward_step(self.engine, batch, options)

    def round(self, step: int) -> dict:
        shape = self.shape
        batch = loop.model_inputs(self.data.batch(self.peek.next_batch()), self.cfg.document_mask)
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        documents = batch.get("document_ids")
        options = self.plain_draft.sample_batch_options(loop.batch_generator(0, step, 0), shape.seq)
        positions = batch.get("document_positions", torch.arange(shape.seq).expand(shape.batch, shape.seq))
        lm_head = []
        sample = {
            "a": timed(lambda: lm_head.append(self.target_forward(ids, positions, documents))),
            "capture": timed(lambda: model_capture(self.model, ids, positions, documents)),
        }
        sample["lm_head"] = lm_head[0]
        features = model_capture(self.model, ids, positions, documents)
        sample["b"] = timed(lambda: self.draft_step(features, ids, loss_mask, documents, options))
        sample["c"] = timed(lambda: self.engine_step(step))
        return sample


def measure(
    shape: Shape,
    zero_stage: int,
    rounds: int,
    warmup: int,
    work: Path,
    document_mask: bool,
    objectives: Sequence[Optional[str]] = (None,),
    temperature: float = 1.0,
    family: str = "glide",
) -> List[dict]:
    """Medians per objective (in `objectives` order; None: the family's default). The objectives'
    steps are interleaved round by round (their order rotated each round), each on the same batch."""
    data = packed_data(shape, rows=shape.batch * (rounds + warmup), out=work / f"{shape.name}-{zero_stage}-{family}")
    if "loss" not in family_keys(FAMILIES[family]):  # its own objective only (MTP: speculators' CE)
        objectives = [None]
    benches = [StepBench(shape, zero_stage, document_mask, spec, temperature, data, family) for spec in objectives]
    times = [{"a": [], "b": [], "c": [], "capture": [], "lm_head": []} for _ in benches]
    for step in range(rounds + warmup):
        turn = step % len(benches)
        for i in [*range(turn, len(benches)), *range(turn)]:
            sample = benches[i].round(step)
            if step >= warmup:
                for key, value in sample.items():
                    times[i][key].append(value)
    results = []
    for bench, samples in zip(benches, times):
        medians = {key: statistics.median(values) for key, values in samples.items()}
        medians["ratio"] = medians["c"] / (medians["a"] + medians["b"])
        medians["lm_head_in_a"] = bench.reads_distribution
        medians["objective"] = bench.objective
        medians["family"] = bench.family
        medians["default_objective"] = bench.spec is None
        results.append(medians)
    base = results[0]  # the family's default objective (GLIDE, DFlash: ce)
    for medians in results:
        medians["c_rel"] = medians["c"] / base["c"]
        medians["b_rel"] = medians["b"] / base["b"]
    return results


def model_capture(model: TargetWithDraft, ids, positions, documents):
    """What the training step runs in the target (the capture the draft asks for)."""
    return capture(model.model, ids, positions, model.draft_model.capture_request(), document_attention(documents))


def objective_specs(arg: str) -> List[Optional[str]]:
    """--objectives -> draft.loss values, CE first as None (the default, measured as before);
    CE is measured whether named or not: the distillation steps are compared with it."""
    specs: List[Optional[str]] = [None]
    for spec in (part.strip() for part in arg.split(",")):
        loss, _, tokens = spec.partition(":")
        objective = parse_objective(loss, where=f"--objectives {spec!r}")  # one-line error if bad
        if tokens not in ("", "all") or (tokens and not objective.needs_teacher):
            raise SystemExit(
                f"--objectives {spec!r}: after ':' only 'all' (draft.distill_tokens: all), "
                f"for an objective with a teacher term"
            )
        if objective.needs_teacher:
            specs.append(spec)
        elif objective.names != ("ce",) or objective.weight("ce") != 1.0:
            raise SystemExit(f"--objectives {spec!r}: without a teacher only plain 'ce' (always measured)")
    return list(dict.fromkeys(specs))


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="glide", help="comma-separated draft.type values")
    parser.add_argument("--shapes", default="demo,large")
    parser.add_argument("--zero", default="0,2")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per shape and stage")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--no-document-mask",
        dest="document_mask",
        action="store_false",
        help="windows as one stream (positions 0..T-1, no document borders)",
    )
    parser.add_argument(
        "--objectives",
        default="ce",
        help="comma-separated draft.loss values, e.g. 'ce,0.9*tv + 0.1*ce' (ce always runs)",
    )
    parser.add_argument(
        "--distill-temperature",
        type=float,
        default=1.0,
        help="draft.distill_temperature of the distillation objectives",
    )
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",")]
    unknown = [f for f in families if f not in FAMILY_SETTINGS]
    if unknown:
        parser.error(f"--families: unknown family {unknown[0]!r} (choose from {', '.join(FAMILY_SETTINGS)})")
    specs = objective_specs(args.objectives)
    distill = len(specs) > 1
    init_distributed()
    work = Path(tempfile.mkdtemp(prefix="specdraft-bench-step-"))
    what = (
        "(a) = model.model under no_grad, attending inside each document, plus lm_head where the objective "
        "reads the target's distribution (EAGLE-3's soft_ce, DSpark's tv, distillation; not GLIDE's or "
        "DFlash's ce)"
    )
    if distill:
        what += (
            "; 'lm_head ms' is that part of (a); c/c_ce, b/b_ce: (c), (b) over the default objective's on "
            "the same batches, interleaved round by round"
        )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {what}; "
        f"document_mask={args.document_mask} (conversations of 64-512 tokens packed)"
    )
    extra = f" {'lm_head ms':>10} {'c/c_ce':>7} {'b/b_ce':>7}  objective" if distill else ""
    print(
        f"{'family':<8}{'shape':<6} {'ZeRO':>4} {'B x T':>9} {'(a) ms':>8} {'(b) ms':>8} {'(c) ms':>8} "
        f"{'capture ms':>10} {'(c)/(a+b)':>9}{extra}"
    )
    worst = {}
    worst_family = {}  # (shape, family) -> the worst ratio of the family's default objective over stages
    worst_distill = {}  # shape -> (ratio, c/c_ce, b/b_ce), each the worst over stages and objectives
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for stage, family in ((stage, family) for stage in map(int, args.zero.split(",")) for family in families):
            results = measure(
                shape,
                stage,
                args.rounds,
                args.warmup,
                work,
                args.document_mask,
                specs,
                args.distill_temperature,
                family,
            )
            for m in results:
                line = (
                    f"{family:<8}{name:<6} {stage:>4} {f'{shape.batch}x{shape.seq}':>9} {m['a'] * 1e3:8.1f} "
                    f"{m['b'] * 1e3:8.1f} {m['c'] * 1e3:8.1f} {m['capture'] * 1e3:10.1f} {m['ratio']:9.3f}"
                )
                if distill:
                    line += f" {m['lm_head'] * 1e3:10.1f} {m['c_rel']:7.3f} {m['b_rel']:7.3f}  {m['objective']}"
                print(line, flush=True)
                if m["default_objective"]:
                    worst[name] = max(worst.get(name, 0.0), m["ratio"])
                    worst_family[name, family] = max(worst_family.get((name, family), 0.0), m["ratio"])
                else:
                    old = worst_distill.get(name, (0.0, 0.0, 0.0))
                    worst_distill[name] = tuple(max(x, y) for x, y in zip(old, (m["ratio"], m["c_rel"], m["b_rel"])))
    last = list(worst)[-1]
    tail = "".join(f" ratio_{family}={worst_family[last, family]:.3f}" for family in families)
    if distill:
        ratio, step, draft = worst_distill[last]
        tail += f" distill_ratio={ratio:.3f} distill_step_ratio={step:.3f} distill_draft_ratio={draft:.3f}"
    print(f"ratio={worst[last]:.3f}{tail}")
    return {
        "ratio": worst[last],
        "families": {f: worst_family[last, f] for f in families},
        "distill": worst_distill.get(last),
    }


if __name__ == "__main__":
    main()
