"""Run on 2 ranks by tests/test_sequence_parallel.py: sequence parallelism (SP=2) against one rank.

Part "model": every family and both objectives (ce; kl, which reads the target's distribution;
EAGLE-3 and P-EAGLE also lk_alpha and lk_lambda, whose lam all-reduces every rank's acceptance),
TargetWithDraft's loss and every draft gradient at SP=2 against the same batch on one rank without
SP (computed here on each rank, no process group), packed documents with borders on both sides of
the shard boundary. Part "memory": per rank, the live tensor bytes of one training step at SP=2
and at SP=1 against the memory model's prediction for that size (test_memory.py's target and
family defaults). Part "train" (argv): training runs of the loop (see the test file).
"""

import json
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from helpers import random_llama  # noqa: E402
from specdraft.config import DraftConfig  # noqa: E402
from specdraft.drafts.registry import build_draft  # noqa: E402
from specdraft.drafts.eagle3.vocab import vocab_maps  # noqa: E402
from specdraft.parallel.sequence import sequence_parallel_groups  # noqa: E402
from specdraft.train.model import TargetWithDraft  # noqa: E402

FAMILIES = ("glide", "eagle3", "dflash", "dspark", "peagle", "dflash2")
OBJECTIVES = ("ce", "kl")
LK = ("lk_alpha", "lk_lambda")  # EAGLE-3 and P-EAGLE: lk_lambda's lam is a mean over every rank's rows


def batch(T=32):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 96, (2, T), generator=g)
    loss_mask = (torch.rand(2, T, generator=g) < 0.8).long()
    # shard boundary at 16: row 0 borders at 11 and 21 (a document across it), row 1 at 16 and 27
    borders = [[0, 11, 21, T], [0, 16, 27, T]]
    documents = torch.zeros(2, T, dtype=torch.long)
    positions = torch.zeros(2, T, dtype=torch.long)
    for b, row in enumerate(borders):
        for d, (s, e) in enumerate(zip(row[:-1], row[1:])):
            documents[b, s:e] = d
            positions[b, s:e] = torch.arange(e - s)
    return ids, loss_mask, documents, positions


def draft_for(family, objective, target):
    cfg = OmegaConf.merge(OmegaConf.structured(DraftConfig), {"type": family, "loss": objective})
    if family in ("eagle3", "peagle"):  # smaller than the target's: in_vocab and LK read its whole vocab
        cfg.draft_vocab_size = 64
    if family == "eagle3":
        cfg.ttt_steps = 3
    if family == "peagle":  # r_min high enough that the deeper depths hold slots on both ranks
        cfg.num_depths, cfg.down_sample_ratio_min = 4, 0.5
    if family in ("dflash", "dspark", "dflash2"):
        cfg.block_size = 4
    if family == "dflash2":  # the tiny target's hidden is 64, its vocab 96
        cfg.selector_rank, cfg.selector_top_k = 8, 4
    draft = build_draft(cfg, target.config)
    if family in ("eagle3", "peagle"):
        counts = torch.randint(0, 1000, (96,), generator=torch.Generator().manual_seed(2)).numpy()
        draft.set_vocab_maps(*vocab_maps(counts, 64))
    return draft


def options(family):
    return {
        "glide": {"lag": 2},
        "dflash": {"anchor_seed": 5},
        "dspark": {"anchor_seed": 5},
        "dflash2": {"anchor_seed": 5},
        "peagle": {"cod_seed": 5},
    }.get(family, {})


# targets with windowed layers (window 8 < T = 32, so a window crosses the shard border at 16):
# gpt-oss (alternating sliding / full, attention sinks split by head) and Gemma 3 (local layers with
# their own RoPE, the last one local), every family that trains on each, one objective
WINDOWED = {"gpt_oss": FAMILIES, "gemma3_text": ("glide", "eagle3", "peagle")}


def windowed_target(model_type):
    from target_zoo import BUILDERS

    model_class, config = BUILDERS[model_type]()
    config.vocab_size, config.sliding_window = 96, 8
    torch.manual_seed(0)
    return model_class(config).eval().requires_grad_(False)


def model_part(sp):
    targets = {"": random_llama(vocab=96, layers=4, heads=4, kv_heads=2)}
    cases = [("", family, objective) for family in FAMILIES for objective in OBJECTIVES]
    cases += [("", family, objective) for family in ("eagle3", "peagle") for objective in LK]
    for model_type, families in WINDOWED.items():
        targets[f"{model_type}/"] = windowed_target(model_type)
        cases += [(f"{model_type}/", family, "ce") for family in families]
    ids, loss_mask, documents, positions = batch()
    report = {}
    for prefix, family, objective in cases:
        target = targets[prefix]
        runs = []
        for parallel in (None, sp):
            draft = draft_for(family, objective, target)
            model = (
                TargetWithDraft(target, draft, sequence_parallel=parallel)
                if parallel
                else TargetWithDraft(target, draft)
            )
            out = model(ids, loss_mask, positions, documents, **options(family))
            out.loss.backward()
            grads = {
                n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in draft.named_parameters()
                if p.requires_grad
            }
            loss, weight, correct = out.loss.detach().double(), out.tokens.double(), out.correct.double()
            if parallel is not None:  # what DeepSpeed and the loop make of the ranks' values
                for g in grads.values():
                    dist.all_reduce(g)
                    g /= sp.size
                sums = torch.stack([loss * weight, weight, correct])
                dist.all_reduce(sums)
                loss, weight, correct = sums[0] / sums[1], sums[1], sums[2]
            runs.append((loss, weight, correct, grads))
        (l0, w0, c0, g0), (l1, w1, c1, g1) = runs
        worst = max(((g0[n] - g1[n]).abs().max() / g0[n].abs().max().clamp_min(1e-12)).item() for n in g0)
        report[f"{prefix}{family}/{objective}"] = {
            "loss": [l0.item(), l1.item()],
            "tokens": [w0.item(), w1.item()],
            "correct": [c0.item(), c1.item()],
            "grad_rel": worst,
            "grad_nonzero": sum(int(g.abs().sum() > 0) for g in g0.values()),
            "params": len(g0),
        }
    report["gather/permuted_gradient"] = gather_permuted_gradient(sp)
    return report


def gather_permuted_gradient(sp):
    """SequenceShard.gather's backward for a gradient that is dense but not contiguous (an SDPA
    key's): the max error of x.grad against the sum of every rank's gradient of its shard."""
    shard = sp.shard(8)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1, 8, 2, 3, generator=g).transpose(1, 2) for _ in range(2)]  # (1, 2, 8, 3), permuted
    x = torch.randn(1, 2, 4, 3, requires_grad=True)
    (shard.gather(x, dim=2) * grads[sp.rank]).sum().backward()
    expected = (grads[0] + grads[1])[:, :, shard.start : shard.end]
    return (x.grad - expected).abs().max().item()


# (family, T, draft keys, loss mask on the first half only): GLIDE longer than 2 windows (its band
# mask spans the whole sequence at any SP size); DFlash and DSpark with every trained token in rank
# 0's half, so that rank holds every anchor (the model's bound under SP is that case)
MEMORY_CASES = (
    ("glide", 2048, {"sliding_window": 512}, False),
    ("eagle3", 512, {}, False),
    ("peagle", 512, {}, False),
    ("dflash", 256, {}, True),
    ("dspark", 256, {}, True),
)


def memory_part(sp):
    """{case: {"1" / "2": {"ranks": live peak bytes per rank, "model": predicted}}}, one
    conversation per row ("one") and packed, 4 conversations a row ("packed")."""
    from transformers import AutoModelForCausalLM

    from specdraft.train.live_bytes import LiveTensorBytes
    from specdraft.train import memory
    from test_memory import FIXED, TARGET, config

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(TARGET).eval().requires_grad_(False)
    report = {}
    for family, T, keys, first_half in MEMORY_CASES:
        for packed in (False, True):
            cfg = config(family, T, documents=packed)
            cfg.per_device_batch_size = 1
            cfg.draft.update(keys)
            ids = torch.randint(0, TARGET.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
            mask = torch.ones_like(ids)
            if first_half:
                mask[:, T // 2 :] = 0
            documents = (
                {
                    "document_positions": (torch.arange(T) % (T // 4))[None],
                    "document_ids": (torch.arange(T) // (T // 4))[None],
                }
                if packed
                else {}
            )
            sizes = {}
            for parallel in (None, sp):
                draft = build_draft(cfg.draft, TARGET)
                model = TargetWithDraft(
                    target, draft, cfg.loss_chunk_size, **({"sequence_parallel": parallel} if parallel else {})
                )
                for param in draft.parameters():  # the fixed terms' gradients, already there
                    param.grad = torch.zeros_like(param) if param.requires_grad else None
                options = draft.sample_batch_options(torch.Generator().manual_seed(0), T)
                with LiveTensorBytes() as live:
                    model(ids, mask, **documents, **options).loss.backward()
                size = parallel.size if parallel else 1
                estimate = memory.estimate_peak(TARGET, cfg, world_size=size, documents=packed, sequence_parallel=size)
                ranks = [None] * sp.size
                dist.all_gather_object(ranks, live.peak)
                sizes[str(size)] = {
                    "ranks": ranks,
                    "model": estimate.total - sum(estimate.parts[name] for name in FIXED),
                }
            report[f"{family}/{'packed' if packed else 'one'}"] = sizes
    return report


def train_part(target, data_dir, work, resume_from, only=""):
    """EAGLE-3 at SP=2 on 2 ranks: 8 steps saved at 4 and 8; the same resumed at step 4 (same size);
    resume_from (a slot of a 1-rank SP=1 run, or "-"): resumed at SP=2. P-EAGLE: 8 steps at SP=2
    saved at 4 (the test resumes it at SP=1). only="chain": just the last hop of SP=2 -> SP=1 ->
    SP=2, resumed at SP=2 from resume_from (the middle, 1-rank run's slot)."""
    from helpers import run_overrides
    from specdraft.config import load_config
    from specdraft.train.loop import train

    def run(name, *extra, family="eagle3"):
        overrides = run_overrides(
            target,
            data_dir,
            f"{work}/{name}",
            f"{work}/cache",
            max_steps=8,
            save_steps=4,
            per_device_batch_size=2,
            sequence_parallel_size=2,
            **{"draft.type": family},
        )
        return train(load_config(None, overrides + list(extra)), log=lambda *a: None).losses

    if only == "chain":
        return {"chain_sp2": run("chain_sp2", f"resume={resume_from}")}
    results = {
        "sp2": run("sp2"),
        "sp2_resumed": run("sp2_again", f"resume={work}/sp2/ckpt/step_4"),
        "peagle_sp2": run("peagle_sp2", family="peagle"),
    }
    if resume_from != "-":
        results["sp1_to_sp2"] = run("sp1_to_sp2", f"resume={resume_from}")
    return results


if __name__ == "__main__":
    out_json = sys.argv[1]
    dist.init_process_group("gloo")
    sp = sequence_parallel_groups(2)
    results = {"model": model_part(sp), "memory": memory_part(sp)} if len(sys.argv) == 2 else {}
    if len(sys.argv) > 2:  # target, data dir, work dir, the slot an SP=2 run resumes from ("-": none)[, "chain"]
        results["train"] = train_part(*sys.argv[2:7])
    if dist.get_rank() == 0:
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
