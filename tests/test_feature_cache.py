"""The feature cache (issue 56): `specdraft capture` writes each conversation's target features
once; training reads them (offline: the target's layers never built; hybrid: rows missing are
computed and committed).

What is pinned:
- every family trains from the cache to the online run's losses, weights and Adam moments, bit
  for bit in fp32 (capture runs the very windows training runs, through the same target pass);
- several drafts from one cache; exact resume from a slot;
- a capture killed at any instant and rerun holds every conversation exactly once; 2 ranks write
  disjoint shards under one manifest; a full disk stops it in one line and keeps what it committed;
- a corrupted, truncated, swapped or stale shard, a missing manifest or a foreign target is
  refused in one line (a property test over random damage: refused, or the exact losses);
- hybrid: the first epoch commits what it computes, later epochs read it, and a resume trains
  to the same losses whichever rows were committed;
- fp8 stores speculators' per-token layout (hs-connectors), or one scale per token and tensor.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdraft.config import load_config
from specdraft.errors import SpecdraftError
from specdraft.features.manifest import MANIFEST, Manifest, committed_shards
from specdraft.features.rows import row_keys
from specdraft.features.shards import bytes_per_token, decode_value, encode_values, row_keys_of
from specdraft.train.loop import train
from helpers import (
    REPO,
    TrainingSpy,
    assert_same_states,
    free_port,
    launch_env,
    qwen3_next_mtp_target,
    run_overrides,
    torchrun,
)
from offline_runs import SMALL

FAMILIES = ("glide", "eagle3", "peagle", "dflash", "dspark", "mtp")
STEPS = 3
ELASTIC_TOLERANCE = 1e-5  # as in tests/test_distributed.py: another world size adds in another order
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def fc(tiny_assets, tmp_path_factory):
    target, tiny = tiny_assets
    work = tmp_path_factory.mktemp("feature_cache")
    return {
        "target": target,
        "mtp_target": qwen3_next_mtp_target(work / "mtp_target", target),
        "work": work,
        "data": Path(tiny.train_files[0]).parent,
    }


def overrides(fc, family, name, *extra):
    target = fc["mtp_target"] if family == "mtp" else fc["target"]
    values = run_overrides(
        target,
        fc["data"],
        f"{fc['work']}/{name}",
        f"{fc['work']}/data",
        **{"draft.type": family},
        **SMALL.get(family, {}),
        packing="whole",
        max_seq_length=256,  # the tiny conversations are 80-160 tokens: 1-3 per window
        per_device_batch_size=2,
        warmup_steps=STEPS,
        max_steps=STEPS,
        save_steps=1,
        keep_last=STEPS,
        zero_stage=2,
    )
    return [*values, *extra]


def cache_of(fc, name, dtype="fp32", *extra):
    return [
        f"feature_cache={fc['work']}/{name}",
        f"feature_cache_dtype={dtype}",
        "feature_cache_shard_tokens=600",
        *extra,
    ]


def capture(args):
    from specdraft.commands.capture import capture as run_capture

    return run_capture(load_config(None, args), log=lambda *a: None)


def run(args, monkeypatch=None):
    spy = TrainingSpy(monkeypatch) if monkeypatch is not None else None
    losses = train(load_config(None, args), log=lambda *a: None).losses
    return losses, spy


def stored_rows(cache_dir):
    """Every row key of every committed shard, with repeats."""
    manifest = Manifest.read(cache_dir)
    return [key for entry in committed_shards(cache_dir, manifest) for key in row_keys_of(cache_dir, entry)]


def data_keys(fc):
    return row_keys(whole_data(fc))


# -- every family: offline = online, bit for bit ----------------------------------------------


def test_distilling_every_token_trains_from_the_cache_to_the_online_losses(fc):
    """The smollm2 preset's GLIDE keys (soft CE on every token, whole windows with padding): the
    cache stores no padding, and 'all' teaches none, so offline = online bit for bit. Taught
    padding parted them (SmolLM2, 200 steps: 3.6406 against 3.6403)."""
    keys = ("draft.loss=soft_ce", "draft.distill_tokens=all")
    online, _ = run(overrides(fc, "glide", "online_all_tokens", *keys))
    capture(overrides(fc, "glide", "capture_all_tokens", *keys, *cache_of(fc, "fc_all_tokens")))
    offline, _ = run(overrides(fc, "glide", "offline_all_tokens", *keys, *cache_of(fc, "fc_all_tokens")))
    assert offline == online and len(online) == STEPS


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_trains_from_the_cache_to_the_online_losses_weights_and_moments(fc, family, monkeypatch):
    online, spy = run(overrides(fc, family, f"online_{family}"), monkeypatch)
    online_states = spy.snapshots
    assert capture(overrides(fc, family, f"capture_{family}", *cache_of(fc, f"fc_{family}")))["rows"] == 48

    import specdraft.train.loop as loop

    def no_layers(*a, **k):
        raise AssertionError("offline training built the target's layers")

    monkeypatch.setattr(loop, "load_frozen_target", no_layers)
    offline, spy = run(overrides(fc, family, f"offline_{family}", *cache_of(fc, f"fc_{family}")), monkeypatch)
    assert offline == online and len(online) == STEPS
    assert_same_states(spy.snapshots, online_states)
    # the offline draft never read a layer: its target module holds no decoder layer
    assert len(spy.engine.module.model.layers) == 0

    # resumed from step 1: steps 2-3 again, bit for bit
    resumed, spy = run(
        overrides(
            fc,
            family,
            f"resumed_{family}",
            *cache_of(fc, f"fc_{family}"),
            f"resume={fc['work']}/offline_{family}/ckpt/step_1",
        ),
        monkeypatch,
    )
    assert resumed == online[1:]
    assert_same_states(spy.snapshots[1:], online_states[2:])


def test_several_drafts_train_from_one_cache_to_their_online_losses(fc):
    sections = {
        f: dict({"type": f}, **{k[len("draft.") :]: v for k, v in SMALL.get(f, {}).items()})
        for f in FAMILIES
        if f != "mtp"
    }
    several = [a for a in overrides(fc, "glide", "x") if not a.startswith("draft.") and not a.startswith("output_dir")]
    several.append(f"drafts={json.dumps(sections)}")
    online = train(load_config(None, [*several, f"output_dir={fc['work']}/several_online"]), log=lambda *a: None)
    capture([*several, f"output_dir={fc['work']}/several_cap", *cache_of(fc, "fc_several")])
    manifest = Manifest.read(fc["work"] / "fc_several")
    # the union of the drafts' reads: GLIDE's K/V, EAGLE-3's / DFlash's layers, the final norm's output
    assert {"last_keys", "last_values", "final_hidden"} <= set(manifest.kinds)
    offline = train(
        load_config(None, [*several, f"output_dir={fc['work']}/several_offline", *cache_of(fc, "fc_several")]),
        log=lambda *a: None,
    )
    assert offline.draft_losses == online.draft_losses and len(online.draft_losses) == 5


# -- capture: exactly once, ranks, full disk ---------------------------------------------------


def test_a_capture_killed_at_any_instant_and_rerun_holds_every_conversation_once(fc, tmp_path):
    args = overrides(fc, "eagle3", "kill", *cache_of(fc, "fc_kill"))
    capture(overrides(fc, "eagle3", "clean", *cache_of(fc, "fc_clean")))  # the reference
    (tmp_path / "overrides.json").write_text(json.dumps(args))
    out = __import__("subprocess").run(
        [
            sys.executable,
            str(REPO / "tests" / "capture_kill_script.py"),
            str(tmp_path / "overrides.json"),
            str(free_port()),
            "6",
            "3.0",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=launch_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(t["killed"] for t in report["trials"][:4]), report  # every injection point was reached
    assert report["final_status"] == 0
    cache = fc["work"] / "fc_kill"
    keys = stored_rows(cache)
    assert sorted(keys) == sorted(set(data_keys(fc))) and len(keys) == 48  # each conversation exactly once
    listed = {e.file for e in committed_shards(cache, Manifest.read(cache))}
    on_disk = {f"shards/{p.name}" for p in (cache / "shards").iterdir()}
    assert on_disk == listed  # no half-written or uncommitted file left
    # and the features are the clean capture's: offline training gives its losses
    clean, _ = run(overrides(fc, "eagle3", "from_clean", *cache_of(fc, "fc_clean")))
    killed, _ = run(overrides(fc, "eagle3", "from_killed", *cache_of(fc, "fc_kill")))
    assert killed == clean


def test_two_ranks_capture_disjoint_shards_under_one_manifest_and_sequence_parallel_reads_its_part(fc, tmp_path):
    cache = fc["work"] / "fc_ranks"
    args = overrides(fc, "dflash", "ranks", *cache_of(fc, "fc_ranks"))
    (tmp_path / "capture.json").write_text(json.dumps(args))
    out = torchrun(REPO / "tests" / "capture_ranks_script.py", "capture", tmp_path / "capture.json")
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = Manifest.read(cache)
    files = [e.file for e in manifest.shards]
    assert any("/r0-" in f for f in files) and any("/r1-" in f for f in files)
    assert {e.file for e in committed_shards(cache, manifest)} == set(files)  # one manifest covers both
    keys = stored_rows(cache)
    assert len(keys) == len(set(keys)) == 48
    # 2 ranks sharing each sequence: online and from the cache give the same losses
    sp = ["sequence_parallel_size=2", "per_device_batch_size=2"]
    for name, extra in (("sp_online", []), ("sp_offline", cache_of(fc, "fc_ranks"))):
        (tmp_path / f"{name}.json").write_text(json.dumps(overrides(fc, "dflash", name, *sp, *extra)))
    online = torchrun(REPO / "tests" / "capture_ranks_script.py", "train", tmp_path / "sp_online.json")
    offline = torchrun(REPO / "tests" / "capture_ranks_script.py", "train", tmp_path / "sp_offline.json")
    assert online.returncode == 0 and offline.returncode == 0, (online.stderr[-2000:], offline.stderr[-2000:])

    def losses(out):
        return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])["losses"]

    assert losses(offline) == losses(online) and len(losses(online)) == STEPS

    # elastic: a 2-rank run from the cache resumes on 1 rank (DeepSpeed's universal format, 2
    # accumulation steps for the same global batch of 4) and continues its losses
    args = overrides(fc, "dflash", "dp_offline", *cache_of(fc, "fc_ranks"))
    (tmp_path / "dp.json").write_text(json.dumps(args))
    two = torchrun(REPO / "tests" / "capture_ranks_script.py", "train", tmp_path / "dp.json")
    assert two.returncode == 0, two.stderr[-2000:]
    resumed, _ = run(
        overrides(fc, "dflash", "dp_resumed", *cache_of(fc, "fc_ranks"), f"resume={fc['work']}/dp_offline/ckpt/step_1")
    )
    straight = losses(two)[1:]
    assert len(resumed) == len(straight) == STEPS - 1
    assert max(abs(a - b) for a, b in zip(resumed, straight)) <= ELASTIC_TOLERANCE, (resumed, straight)


def test_a_full_disk_stops_the_capture_in_one_line_and_keeps_what_it_committed(fc, monkeypatch):
    import errno

    import specdraft.features.shards as shards_module

    calls, write = {"n": 0}, shards_module.write_atomic

    def full_after_two(path, payload):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, payload)

    monkeypatch.setattr(shards_module, "write_atomic", full_after_two)
    args = overrides(fc, "glide", "full", *cache_of(fc, "fc_full"))
    with pytest.raises(SpecdraftError) as err:
        capture(args)
    assert str(err.value).startswith(f"{fc['work'] / 'fc_full'}: the disk is full") and "\n" not in str(err.value)
    cache = fc["work"] / "fc_full"
    assert len(stored_rows(cache)) > 0 and len(committed_shards(cache, Manifest.read(cache))) == 2
    monkeypatch.setattr(shards_module, "write_atomic", write)
    capture(args)  # the same command again goes on
    assert sorted(stored_rows(cache)) == sorted(set(data_keys(fc)))


def test_a_capture_says_what_it_will_write_before_writing_it(fc):
    from specdraft.commands.capture import capture as run_capture

    lines = []
    args = overrides(fc, "eagle3", "sizes", *cache_of(fc, "fc_sizes", "bf16"))
    written = run_capture(load_config(None, args), log=lines.append)
    manifest = Manifest.read(fc["work"] / "fc_sizes")
    # EAGLE-3 on the tiny target (hidden 64, 2 layers): layer inputs 0, 1, the last output 2 and the
    # final norm's output (its objective reads the target's distribution), in bf16, and its token
    # id: 4 x 64 x 2 + 4 bytes
    assert list(manifest.kinds) == ["hidden.0", "hidden.1", "hidden.2", "final_hidden"]
    said = next(line for line in lines if " bytes per token; " in line)
    assert "bf16: 516 bytes per token; " in said and f"{written['tokens']:,} tokens of" in said, said
    # what landed: those bytes per token, plus per shard its header, row keys and offsets
    entries = committed_shards(fc["work"] / "fc_sizes", manifest)
    payload = sum(e.tokens for e in entries) * 516
    overhead = sum(e.bytes for e in entries) - payload
    assert 0 < overhead <= sum(2048 + 24 * e.rows for e in entries), overhead


# -- refusals ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_cache(fc):
    capture(overrides(fc, "eagle3", "good", *cache_of(fc, "fc_good")))
    losses, _ = run(overrides(fc, "eagle3", "good_offline", *cache_of(fc, "fc_good")))
    return fc["work"] / "fc_good", losses


def copy_cache(good, dest):
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(good, dest)
    return dest


def refusal(fc, name, cache_dir, *extra, before_step_1=True):
    """The one-line refusal of an offline run on cache_dir; before_step_1: nothing was trained (a
    shard is checked when first read: its refusal may come after steps that never read it)."""
    with pytest.raises(SpecdraftError) as err:
        run(overrides(fc, "eagle3", name, f"feature_cache={cache_dir}", *extra))
    message = str(err.value)
    assert "\n" not in message
    if before_step_1:
        assert not (fc["work"] / name / "ckpt").exists() or not any((fc["work"] / name / "ckpt").glob("step_*"))
    return message


def test_a_foreign_cache_is_refused_before_step_1_naming_what_differs(fc, good_cache, tmp_path):
    good, _ = good_cache
    # captured for GLIDE: no EAGLE-3 layers
    capture(overrides(fc, "glide", "glide_cap", *cache_of(fc, "fc_glide_only")))
    message = refusal(fc, "r1", fc["work"] / "fc_glide_only")
    assert (
        message.startswith(f"{fc['work'] / 'fc_glide_only' / MANIFEST}: no hidden.")
        and "capture with this run's" in message
    )
    # another target: the manifest's fingerprint differs
    other = copy_cache(good, tmp_path / "other_target")
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["fingerprints"]["target"] = "0" * 16
    (other / MANIFEST).write_text(json.dumps(manifest))
    assert "captured from another target" in refusal(fc, "r2", other)
    # another template (thinking on)
    assert "captured from another template" in refusal(fc, "r3", good, "thinking=true")
    # no manifest
    gone = copy_cache(good, tmp_path / "no_manifest")
    (gone / MANIFEST).unlink()
    assert (
        refusal(fc, "r4", gone)
        == f"{gone / MANIFEST}: missing: {gone} is not a feature cache (`specdraft capture CONFIG` writes one)"
    )
    # rows of the data the cache never saw (captured at a shorter length: fewer tokens per row)
    capture(overrides(fc, "eagle3", "short_cap", *cache_of(fc, "fc_short"), "max_seq_length=128"))
    assert "conversations of the data are not in the cache" in refusal(fc, "r5", fc["work"] / "fc_short")


# the damage a property test draws: (what, shard index, byte offset fraction)
DAMAGE = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "swap", "delete_manifest", "none"]),
        st.integers(0, 50),
        st.floats(0.0, 0.999),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(damage=DAMAGE)
def test_damaged_caches_are_refused_in_one_line_or_train_on_exactly_the_right_features(fc, good_cache, damage):
    good, good_losses = good_cache
    other = fc["work"] / "fc_other"
    if not other.is_dir():  # the same rows from another capture: other shard names' contents
        capture(
            overrides(fc, "eagle3", "other_cap", *cache_of(fc, "fc_other", "fp32", "feature_cache_shard_tokens=900"))
        )
    cache = copy_cache(good, fc["work"] / "fc_damaged")
    shards = sorted((cache / "shards").iterdir())
    for what, index, where in damage:
        shard = shards[index % len(shards)]
        if what == "flip" and shard.exists():
            payload = bytearray(shard.read_bytes())
            payload[int(where * len(payload))] ^= 0xFF
            shard.write_bytes(bytes(payload))
        elif what == "truncate" and shard.exists():
            shard.write_bytes(shard.read_bytes()[: int(where * shard.stat().st_size)])
        elif what == "swap":
            donor = sorted((other / "shards").iterdir())
            shutil.copyfile(donor[index % len(donor)], shard)
        elif what == "delete_manifest":
            (cache / MANIFEST).unlink(missing_ok=True)
    deleted = not (cache / MANIFEST).exists()
    hybrid = copy_cache(cache, fc["work"] / "fc_damaged_hybrid")
    try:
        losses, _ = run(overrides(fc, "eagle3", "damaged", f"feature_cache={cache}", "feature_cache_dtype=fp32"))
    except SpecdraftError as err:
        message = str(err)
        assert "\n" not in message and str(cache) in message, message
    else:  # not refused: exactly the right features (e.g. damage to a shard never read)
        assert losses == good_losses
    finally:
        shutil.rmtree(fc["work"] / "damaged", ignore_errors=True)
    # hybrid: a shard that fails a check is computed again, and the run trains on the right features
    hybrid_args = overrides(
        fc, "eagle3", "damaged", f"feature_cache={hybrid}", "feature_cache_dtype=fp32", "feature_cache_mode=hybrid"
    )
    try:
        if deleted:  # no manifest: a folder of files hybrid will not write into
            with pytest.raises(SpecdraftError, match="exists and is not a feature cache"):
                run(hybrid_args)
        else:
            assert run(hybrid_args)[0] == good_losses
    finally:
        shutil.rmtree(fc["work"] / "damaged", ignore_errors=True)


def test_hybrid_computes_a_corrupted_shard_again_where_offline_refuses_it(fc, good_cache):
    good, good_losses = good_cache
    cache = copy_cache(good, fc["work"] / "fc_corrupted")
    shard = sorted((cache / "shards").iterdir())[0]
    payload = bytearray(shard.read_bytes())
    payload[len(payload) // 2] ^= 0xFF  # among the features' values: the file still parses
    shard.write_bytes(bytes(payload))
    message = refusal(fc, "corrupt_offline", cache, before_step_1=False)
    assert message.startswith(f"{shard}: its bytes are not the ones committed"), message
    lines = []
    args = overrides(fc, "eagle3", "corrupt_hybrid", f"feature_cache={cache}", "feature_cache_mode=hybrid")
    assert train(load_config(None, args), log=lines.append).losses == good_losses
    assert any(line.startswith(f"features: {shard}: its bytes are not") and "computed again" in line for line in lines)
    # the shard is rejected for every later reader; the rows the hybrid run met were committed
    # again, and a capture of the same config adds the rest: offline training reads them all
    assert (cache / "rejected" / f"{shard.name}.json").is_file()
    capture(
        overrides(
            fc,
            "eagle3",
            "corrupt_cap",
            f"feature_cache={cache}",
            "feature_cache_dtype=fp32",
            "feature_cache_shard_tokens=600",
        )
    )
    assert sorted(stored_rows(cache)) == sorted(set(data_keys(fc)))  # each row once among the committed shards
    offline, _ = run(overrides(fc, "eagle3", "corrupt_after", f"feature_cache={cache}"))
    assert offline == good_losses


# -- hybrid ----------------------------------------------------------------------------------


def test_hybrid_commits_the_first_epoch_reads_it_later_and_resumes_exactly(fc, monkeypatch):
    epochs = ["max_steps=-1", "num_train_epochs=2", "warmup_steps=2", "save_steps=100", "keep_last=2"]
    online, _ = run(overrides(fc, "dflash", "hybrid_online", *epochs))
    import specdraft.train.model as model_module

    passes, capture_fn = [], model_module.capture

    def counted(*a, **k):
        passes.append(1)
        return capture_fn(*a, **k)

    monkeypatch.setattr(model_module, "capture", counted)
    hybrid_args = overrides(
        fc, "dflash", "hybrid", *epochs, *cache_of(fc, "fc_hybrid", "fp32", "feature_cache_mode=hybrid")
    )
    hybrid, _ = run(hybrid_args)
    assert hybrid == online  # fp32: live and cached features are the same numbers
    # the target ran for the batches holding a window not yet committed: the first epoch's, and the
    # second epoch's batch with the window the first one dropped (its tail)
    from specdraft.data.sampler import ShardedBatchSampler

    sampler = ShardedBatchSampler(windows_of(fc), 2, 0, 1, 3)
    seen, live = set(), 0
    for _ in range(len(online)):
        batch = set(sampler.next_batch().tolist())
        live += bool(batch - seen)
        seen |= batch
    assert len(passes) == live
    keys, whole = stored_rows(fc["work"] / "fc_hybrid"), whole_data(fc)
    seen_rows = {whole_keys[p.row] for w in seen for p in whole.placements(w) for whole_keys in [data_keys(fc)]}
    assert len(keys) == len(set(keys)) and set(keys) == seen_rows  # every row the run met, committed once
    # the cache now complete: another hybrid run never runs the target
    passes.clear()
    again, _ = run([a for a in hybrid_args if not a.startswith("output_dir=")] + [f"output_dir={fc['work']}/hybrid_2"])
    assert again == online and passes == []


def whole_data(fc):
    """The windows these tests' runs read: the data cache their config keys, not any in the folder
    (another test packs the same files at another max_seq_length beside it)."""
    from specdraft.data.packing import open_packed_cache
    from specdraft.data.whole_packing import WholePackedData
    from specdraft.train.data import data_files_and_cache

    _, cache_dir = data_files_and_cache(load_config(None, overrides(fc, "dflash", "windows")))
    return WholePackedData(cache_dir, open_packed_cache(cache_dir).meta)


def windows_of(fc) -> int:
    return len(whole_data(fc))


def test_a_hybrid_resume_trains_the_same_losses_whichever_rows_were_committed(fc):
    args = overrides(fc, "peagle", "hyb_a", *cache_of(fc, "fc_hyb_a", "bf16", "feature_cache_mode=hybrid"))
    straight, _ = run(args)
    # another cache holding only the first shard the straight run committed: the resumed run
    # computes the rest live (rounded to bf16 as the cache stores them) and reads that one
    partial = fc["work"] / "fc_hyb_b"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "shards").mkdir(parents=True)
    source = Manifest.read(fc["work"] / "fc_hyb_a")
    first = committed_shards(fc["work"] / "fc_hyb_a", source)[0]
    shutil.copyfile(fc["work"] / "fc_hyb_a" / first.file, partial / first.file)
    source.shards = [first]
    source.write(partial)
    resumed, _ = run(
        overrides(
            fc,
            "peagle",
            "hyb_b",
            *cache_of(fc, "fc_hyb_b", "bf16", "feature_cache_mode=hybrid"),
            f"resume={fc['work']}/hyb_a/ckpt/step_1",
        )
    )
    assert resumed == straight[1:]


# -- fp8 and sizes ---------------------------------------------------------------------------


def test_fp8_stores_speculators_per_token_layout_or_a_scale_per_token_and_tensor():
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    torch.manual_seed(0)
    values = {"hidden.1": torch.randn(7, 16) * 3, "final_hidden": torch.randn(7, 16)}
    per_token = encode_values(values, "fp8", "token")
    # speculators' layout (hs_connectors/fp8_utils.py quantize_tensor_to_fp8): one scale per token
    # over every stored value, amax / 448
    expected, scale = quantize_tensor_to_fp8(torch.cat(list(values.values()), dim=1))
    assert torch.equal(per_token["scales"], scale) and per_token["scales"].shape == (7, 1)
    assert torch.equal(per_token["hidden.1"].view(torch.uint8), expected[:, :16].view(torch.uint8))
    per_kind = encode_values(values, "fp8", "token_layer")
    assert set(per_kind) == {"hidden.1", "final_hidden", "hidden.1.scale", "final_hidden.scale"}
    for encoded in (per_token, per_kind):
        for kind, value in values.items():
            back = decode_value(encoded, kind, 0, 7, torch.float32)
            # e4m3: 3 mantissa bits, relative error <= 2^-4 of the scale's range
            bound = (encoded.get("scales", encoded.get(f"{kind}.scale"))) * 448 / 16
            assert ((back - value).abs() <= bound).all()
    # the smaller tensor keeps more precision with its own scale
    small = values["final_hidden"]
    err_token = (decode_value(per_token, "final_hidden", 0, 7, torch.float32) - small).abs().mean()
    err_kind = (decode_value(per_kind, "final_hidden", 0, 7, torch.float32) - small).abs().mean()
    assert err_kind < err_token
    # bytes per token: elements at their width + the token id (+ scales)
    widths = {"hidden.1": 16, "final_hidden": 16}
    assert bytes_per_token(widths, "bf16", "token") == 32 * 2 + 4
    assert bytes_per_token(widths, "fp8", "token") == 32 + 4 + 4
    assert bytes_per_token(widths, "fp8", "token_layer") == 32 + 4 + 8


def test_an_fp8_cache_trains_near_the_fp32_losses(fc):
    capture(overrides(fc, "eagle3", "fp8_cap", *cache_of(fc, "fc_fp8", "fp8")))
    manifest = Manifest.read(fc["work"] / "fc_fp8")
    assert manifest.dtype == "fp8" and manifest.fp8_scale == "token"
    online, _ = run(overrides(fc, "eagle3", "fp8_online"))
    fp8, _ = run(overrides(fc, "eagle3", "fp8_offline", *cache_of(fc, "fc_fp8", "fp8")))
    assert fp8 != online and np.allclose(fp8, online, rtol=2e-2), (fp8, online)


# -- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,message",
    [
        (["packing=stream"], "key 'feature_cache': a feature cache holds whole conversations; set packing: whole"),
        (["document_mask=false"], "key 'feature_cache': a cached conversation was attended alone"),
        (["feature_cache_dtype=fp16"], "key 'feature_cache_dtype': 'fp16' is not one of fp32, bf16, fp8"),
        (["feature_cache_mode=hybrid", "sequence_parallel_size=2"], "key 'feature_cache_mode': hybrid computes whole"),
    ],
)
def test_keys_a_cache_cannot_serve_are_refused_in_one_line(fc, extra, message):
    with pytest.raises(SpecdraftError) as err:
        load_config(None, overrides(fc, "eagle3", "keys", "feature_cache=/nonexistent", *extra))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_glide_moving_the_targets_positions_cannot_use_a_cache(fc):
    with pytest.raises(SpecdraftError) as err:
        load_config(None, overrides(fc, "glide", "anchor", "feature_cache=/x", "draft.anchor_offset=true"))
    assert "anchor_offset" in str(err.value)


def test_the_data_report_shows_what_the_cache_holds(fc, good_cache):
    import io

    from specdraft.commands.data_report import data_report

    good, _ = good_cache
    out = io.StringIO()
    data_report(
        load_config(None, overrides(fc, "eagle3", "report", f"feature_cache={good}")), out=out, log=lambda *a: None
    )
    out = out.getvalue()
    assert f"feature cache: {good}: 48 conversations" in out, out
    assert "this data: 48 of 48 conversations cached" in out
    assert "packing whole: " in out and "hidden.1: input of decoder layer 1" in out


def test_whole_packing_places_every_conversation_once_best_fit():
    from specdraft.data.whole_packing import best_fit

    lengths = np.array([5, 9, 3, 12, 4, 4, 1, 20])
    windows = best_fit(lengths, 10)
    placed = sorted(r for w in windows for r in w)
    assert placed == list(range(8))
    for w in windows:
        assert sum(min(lengths[r], 10) for r in w) <= 10
    # longest first (20 and 12 keep 10 tokens: a tie, lower index first) into the window with the
    # least room that holds it: 3, 7, 1 (room 1), 0 (room 5), 4 -> 0's, 5 new (room 6), 2 -> 5's,
    # 6 (1 token) -> the older of the two windows with room 1
    assert windows == [[3], [7], [1, 6], [0, 4], [5, 2]]
