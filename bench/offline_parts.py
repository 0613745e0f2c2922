"""bench/offline.py's parts: the assets, the captures, the step clocks, the sha256 cost and the
tau judge (kept apart so each file stays one screenful of concerns)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

from acceptance_runs import PRESET_OVERRIDES, family_config  # noqa: E402

PRECISIONS = {  # label -> the cache's keys
    "fp32": ["feature_cache_dtype=fp32"],
    "bf16": ["feature_cache_dtype=bf16"],
    "fp8_token": ["feature_cache_dtype=fp8", "feature_cache_fp8_scale=token"],
    "fp8_token_layer": ["feature_cache_dtype=fp8", "feature_cache_fp8_scale=token_layer"],
}
SPECULATORS_AUX = 3  # speculators stores EAGLE-3's three auxiliary layers and the last hidden state
QUICK = dict(steps=3, warmup=1, train_steps=2, epochs="1,2", max_prompts=2, max_new_tokens=8, gamma=3)


def cannot_draft(family: str, target: str) -> str:
    """Why the family cannot draft for this target ('' when it can): MTP needs a target with an MTP
    layer (the tiny and demo targets are Llama; `--preset mtp` has one)."""
    from specdraft.drafts.registry import FAMILIES

    model_type = json.loads((Path(target) / "config.json").read_text())["model_type"]
    if FAMILIES[family].drafts_for(model_type):
        return ""
    return (
        f"it drafts for {', '.join(FAMILIES[family].target_model_types)} targets, not {model_type} (try --preset mtp)"
    )


class Parts:
    def __init__(self, out: Path):
        self.dir = out / "parts"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.reused: List[str] = []

    def get(self, name: str, compute):
        path = self.dir / f"{name}.json"
        if path.is_file():
            self.reused.append(name)
            print(f"[bench] {name}: reused from {path}", flush=True)
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value, indent=2))
        return value


def quiet(*_):
    pass


# -- runs ----------------------------------------------------------------------------------------


OWN_KEYS = ("logging_steps=", "per_device_batch_size=")  # each run logs what it measures; --batch


def preset_keys(preset: str, family: str) -> List[str]:
    """bench/acceptance.py's keys for this preset and family, but the ones this bench sets itself."""
    keys = [*PRESET_OVERRIDES.get(preset, {}).get("*", []), *PRESET_OVERRIDES.get(preset, {}).get(family, [])]
    return [key for key in keys if not key.startswith(OWN_KEYS)]


def preset_batch(preset: str, default: int) -> int:
    """The preset's per_device_batch_size in bench/acceptance.py's CPU budget (smollm2: 1), else default."""
    for key in PRESET_OVERRIDES.get(preset, {}).get("*", []):
        if key.startswith("per_device_batch_size="):
            return int(key.split("=", 1)[1])
    return default


class Assets:
    def __init__(self, args, out: Path):
        self.out = out
        self.args = args
        self.target, self.prompts, self.data = args.target, args.prompts, args.data
        if self.target is None or self.prompts is None or self.data is None:
            from specdraft.demo.assets import ensure_demo_assets

            target, data = ensure_demo_assets(preset=args.preset)
            self.target = self.target or str(target)
            self.prompts = self.prompts or str(data.prompts_file)
            self.data = self.data or str(Path(data.train_files[0]).parent / "shard-*.jsonl")

    def config(self, family: str, name: str, steps: int, *extra, save_steps=None):
        run_dir = self.out / "runs" / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        keys = [
            "packing=whole",
            f"per_device_batch_size={self.args.batch}",
            "gradient_accumulation_steps=1",
            f"logging_steps={max(1, steps)}",
            f"data_cache_dir={self.out / 'data-cache'}",
            # the preset's CPU budget, as bench/acceptance.py trains it (smollm2: 1 x 256 tokens a step, a
            # smaller EAGLE-3 vocab, fewer DFlash anchors ...); --set over it
            *preset_keys(self.args.preset, family),
            *self.args.shared,
            *extra,
        ]
        return family_config(family, self.target, self.data, self.prompts, run_dir, steps, keys, save_steps)

    def cache(self, family: str, precision: str) -> List[str]:
        return [f"feature_cache={self.out / 'caches' / f'{family}-{precision}'}", *PRECISIONS[precision]]


def run_capture(assets: Assets, family: str, precision: str) -> dict:
    """A fresh capture of the family's features in this precision: tokens/s and bytes per token."""
    from specdraft.commands.capture import capture
    from specdraft.features.manifest import Manifest

    cache_keys = assets.cache(family, precision)
    cache_dir = Path(cache_keys[0].split("=", 1)[1])
    if cache_dir.exists():
        shutil.rmtree(cache_dir)
    cfg = assets.config(family, f"capture-{family}-{precision}", 1, *cache_keys)
    started = time.perf_counter()
    written = capture(cfg, log=quiet)
    seconds = time.perf_counter() - started
    manifest = Manifest.read(cache_dir)
    shard_bytes = sum((cache_dir / s.file).stat().st_size for s in manifest.shards)
    tokens = sum(s.tokens for s in manifest.shards)
    return dict(
        family=family,
        precision=precision,
        kinds=list(manifest.kinds),
        tokens=tokens,
        rows=written["rows"],
        shards=len(manifest.shards),
        seconds=seconds,
        tokens_per_second=written["tokens"] / seconds,
        bytes=shard_bytes,
        bytes_per_token=shard_bytes / tokens,  # files as written: safetensors header and row index too
        formula_bytes_per_token=formula_bytes(assets.target, list(manifest.kinds), manifest.dtype, manifest.fp8_scale),
    )


def formula_bytes(target_dir, kinds, dtype, fp8_scale) -> int:
    from specdraft.commands.capture import _kind_widths
    from specdraft.features.shards import bytes_per_token
    from specdraft.target.checks import load_target_config

    widths = _kind_widths(load_target_config(str(target_dir)), kinds)
    return bytes_per_token(widths, dtype, fp8_scale or "token")


def hidden_size(target_dir) -> int:
    from specdraft.target.checks import load_target_config

    return load_target_config(str(target_dir)).get_text_config().hidden_size


@contextlib.contextmanager
def step_clock():
    """Per step of a one-draft run: seconds reading and assembling the cached features
    (RunFeatures.batch) and seconds of forward_step (the draft's forward + backward + step, with the
    target's pass inside when live)."""
    from specdraft.train import features as features_module
    from specdraft.train import loop

    times = {"read": [], "step": [], "read_cpu": [], "step_cpu": []}
    forward_step, batch = loop.forward_step, features_module.RunFeatures.batch

    def clocked(name, function, *a, **k):
        wall, cpu = time.perf_counter(), time.process_time()
        out = function(*a, **k)
        times[name].append(time.perf_counter() - wall)
        times[f"{name}_cpu"].append(time.process_time() - cpu)
        return out

    def timed_step(*a, **k):
        return clocked("step", forward_step, *a, **k)

    def timed_batch(self, indices):
        return clocked("read", batch, self, indices)

    loop.forward_step, features_module.RunFeatures.batch = timed_step, timed_batch
    try:
        yield times
    finally:
        loop.forward_step, features_module.RunFeatures.batch = forward_step, batch


def time_steps(assets: Assets, family: str) -> dict:
    """The family live and from its bf16 cache, the same steps: medians per step after --warmup."""
    from specdraft.train.loop import train

    args = assets.args
    result = {}
    for mode, extra in (("online", []), ("cached", assets.cache(family, "bf16"))):
        cfg = assets.config(family, f"time-{family}-{mode}", args.steps, *extra)
        with step_clock() as times:
            train(cfg, log=quiet)
        kept = slice(args.warmup, None)
        result[mode] = dict(steps=len(times["step"][kept]))
        for clock in ("", "_cpu"):  # wall seconds, and the process's CPU seconds (steady on a shared machine)
            step = times[f"step{clock}"][kept]
            read = times[f"read{clock}"][kept] if times["read"] else [0.0] * len(step)
            result[mode].update(
                {
                    f"forward_backward{clock}": statistics.median(step),
                    f"read{clock}": statistics.median(read),
                    f"total{clock}": statistics.median([s + r for s, r in zip(step, read)]),
                }
            )
    for clock in ("", "_cpu"):
        result[f"cached_over_draft{clock}"] = (
            result["cached"][f"total{clock}"] / result["cached"][f"forward_backward{clock}"]
        )
        result[f"online_over_cached{clock}"] = result["online"][f"total{clock}"] / result["cached"][f"total{clock}"]
    return result


def drop_page_cache(path: Path) -> None:
    """Evict the file's pages (posix_fadvise DONTNEED: no root needed) so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def verify_cost(assets: Assets, family: str) -> dict:
    """Each shard of the family's bf16 cache: sha256 of its file with the page cache warm (best of
    3) and cold (its pages evicted first: what the first read of a shard pays), and a ShardReader's
    open with and without the check, cold and warm."""
    from specdraft.features.manifest import Manifest
    from specdraft.features.shards import ShardReader, file_sha256

    cache_dir = Path(assets.cache(family, "bf16")[0].split("=", 1)[1])
    manifest = Manifest.read(cache_dir)
    kinds = list(manifest.kinds)
    seconds = dict(hash_warm=0.0, hash_cold=0.0, open_checked=0.0, open_unchecked=0.0, open_checked_cold=0.0)
    total_bytes = 0

    def timed(key, work):
        started = time.perf_counter()
        result = work()
        seconds[key] += time.perf_counter() - started
        return result

    for entry in manifest.shards:
        path = cache_dir / entry.file
        total_bytes += path.stat().st_size
        drop_page_cache(path)
        assert timed("hash_cold", lambda: file_sha256(path)) == entry.sha256
        warm = []
        for _ in range(3):
            started = time.perf_counter()
            assert file_sha256(path) == entry.sha256
            warm.append(time.perf_counter() - started)
        seconds["hash_warm"] += min(warm)
        # verified=True: the caller vouches for the file, so the reader skips the size and sha256 check
        timed("open_unchecked", lambda: ShardReader(cache_dir, entry, kinds, verified=True))
        timed("open_checked", lambda: ShardReader(cache_dir, entry, kinds, verified=False))
        drop_page_cache(path)
        timed("open_checked_cold", lambda: ShardReader(cache_dir, entry, kinds, verified=False))
    return dict(
        shards=len(manifest.shards),
        bytes=total_bytes,
        sha256_seconds=seconds["hash_warm"],
        sha256_mb_per_s=total_bytes / 1e6 / seconds["hash_warm"],
        sha256_cold_seconds=seconds["hash_cold"],
        sha256_cold_mb_per_s=total_bytes / 1e6 / seconds["hash_cold"],
        open_verified_seconds=seconds["open_checked"],
        open_unverified_seconds=seconds["open_unchecked"],
        open_verified_cold_seconds=seconds["open_checked_cold"],
    )


def steps_per_epoch(assets: Assets, family: str) -> int:
    """Optimizer steps that read every window of the packed data once."""
    from specdraft.target.model import load_target_tokenizer
    from specdraft.train.data import prepare_data

    cfg = assets.config(family, "epoch-count", 1)
    data = prepare_data(cfg, load_target_tokenizer(cfg.target), 0, quiet)
    return max(1, -(-len(data) // cfg.per_device_batch_size))


def train_export(assets: Assets, family: str, name: str, steps: int, *extra, save_steps=None):
    """-> the run's last export and its last logged loss."""
    from specdraft.train.loop import train

    cfg = assets.config(family, name, steps, *extra, save_steps=save_steps)
    result = train(cfg, log=quiet)
    return str(result.export_dir), result.losses[-1]


class Judge:
    """Greedy chain tau of exports on the held-out prompts (the decoder of specdraft eval), kept
    per prompt too."""

    def __init__(self, assets: Assets):
        from specdraft.commands.evaluate import load_tokenizer
        from specdraft.decode.measure import run_plain
        from specdraft.decode.prompts import read_prompts, stop_tokens
        from specdraft.target.model import load_frozen_target

        args = assets.args
        self.target = load_frozen_target(str(assets.target), "fp32", torch.device("cpu"))
        tokenizer = load_tokenizer(None, Path(assets.target))
        self.prompts = read_prompts(assets.prompts, tokenizer, args.max_prompts)
        self.settings = dict(
            max_new_tokens=args.max_new_tokens, temperature=0.0, stop=stop_tokens(self.target, tokenizer)
        )
        self.baseline = run_plain(self.target, self.prompts, **self.settings)
        self.gamma = args.gamma

    def tau(self, export: Optional[str]) -> dict:
        """export None: prompt lookup."""
        from specdraft.decode.measure import make_drafter, run_speculative
        from specdraft.decode.report import acceptance_stats
        from specdraft.export.files import load_exported_draft

        draft = None if export is None else load_exported_draft(Path(export))[0]
        drafter = make_drafter("prompt_lookup" if draft is None else "draft", self.target, draft)
        generations = run_speculative(self.target, drafter, self.prompts, gamma=self.gamma, **self.settings)
        report = acceptance_stats(generations, self.gamma)
        return dict(
            tau=report["tau"],
            per_position=report["acceptance_per_position"],
            lossless=all(g.tokens == b.tokens for g, b in zip(generations, self.baseline)),
            # per prompt: (tokens its passes produced, passes): the paired interval of tau_ratio
            per_prompt=[[sum(g.accepted) + len(g.accepted), len(g.accepted)] for g in generations],
        )


def tau_ratio(over: dict, under: dict, draws: int = 2000, seed: int = 0) -> dict:
    """tau(over) / tau(under) on the same prompts, and its 95% interval from a paired bootstrap
    over prompts (the same resampled prompts for both): whether a gap is larger than the prompts'
    noise."""
    import random

    a, b = over["per_prompt"], under["per_prompt"]
    assert len(a) == len(b), "both drafts are measured on the same prompts"

    def ratio(indices):
        produced_a, passes_a = sum(a[i][0] for i in indices), sum(a[i][1] for i in indices)
        produced_b, passes_b = sum(b[i][0] for i in indices), sum(b[i][1] for i in indices)
        return (produced_a / passes_a) / (produced_b / passes_b)

    rng = random.Random(seed)
    n = len(a)
    samples = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return dict(ratio=ratio(range(n)), low=samples[int(0.025 * draws)], high=samples[int(0.975 * draws) - 1])


# -- the run -------------------------------------------------------------------------------------
