"""Run on 2 ranks by tests/test_distributed.py: train + resume at ZeRO 1-3, grow 1 -> 2 ranks.

Also records, per rank, the files it fsynced during saves and the checkpoint files it verified
and loaded during resumes (in order), for the per-rank durability / verification tests.
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 collective renames, every step

import torch  # noqa: E402

from helpers import capturing_save, keep_universal_copies, run_overrides  # noqa: E402
from specdraft.config import load_config  # noqa: E402
from specdraft.checkpoint import manager as checkpoint, slots  # noqa: E402
from specdraft.train.loop import train  # noqa: E402

target, data_dir, work, out_json = sys.argv[1:5]
rank = int(os.environ["RANK"])
events = []  # ("fsync" | "verified" | "loaded", path), in order
verifying = []  # non-empty inside verify_files, whose own weights-only unpickling is the check, not a load

real_fsync, real_load, real_verify = os.fsync, torch.load, slots.verify_files


def spy_fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)


def spy_load(f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and "/ckpt/" in str(f) and not verifying:
        events.append(("loaded", os.path.abspath(f)))
    return real_load(f, *args, **kwargs)


def spy_verify(slot_dir, record, names=None):
    verifying.append(slot_dir)
    try:
        real_verify(slot_dir, record, names)
    finally:
        verifying.pop()
    for name in sorted(record["files"]) if names is None else names:
        events.append(("verified", os.path.abspath(os.path.join(slot_dir, name))))


os.fsync, torch.load, slots.verify_files = spy_fsync, spy_load, spy_verify
checkpoint.CheckpointManager.save = capturing_save(checkpoint.CheckpointManager.save, 6)
keep_universal_copies(f"{work}/copies")  # the grown runs' conversions, for the tests to read


def base(stage, name, *extra):
    overrides = run_overrides(
        target,
        data_dir,
        f"{work}/{name}",
        f"{work}/cache",
        per_device_batch_size=2,
        max_steps=12,
        save_steps=6,
        zero_stage=stage,
    )
    return load_config(None, [*overrides, *extra])


results = {}
for stage in (1, 2, 3):
    results[f"full{stage}"] = train(base(stage, f"two{stage}"), log=lambda *a: None).losses
for stage in (2, 3):  # same size: bit-identical
    results[f"resumed{stage}"] = train(
        base(stage, f"again{stage}", f"resume={work}/two{stage}/ckpt/step_6"), log=lambda *a: None
    ).losses
for stage in (1, 2):  # 1 rank -> 2 ranks, through the universal format
    results[f"grown{stage}"] = train(
        base(stage, f"grown{stage}", f"resume={work}/one{stage}/ckpt/step_6"), log=lambda *a: None
    ).losses

with open(f"{work}/events_rank{rank}.json", "w") as f:
    json.dump(events, f)
if rank == 0:
    with open(out_json, "w") as f:
        json.dump(results, f)
