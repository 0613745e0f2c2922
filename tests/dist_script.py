"""Run on 2 ranks by tests/test_distributed.py: train + resume at ZeRO 2 and 3, losses to JSON."""

import json
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 collective renames, every step

from specdraft.config import load_config  # noqa: E402
from specdraft.train.loop import train  # noqa: E402

target, data_dir, work, out_json = sys.argv[1:5]
results = {}
for stage in (2, 3):
    base = [f"target={target}", f"data_files={data_dir}/*.jsonl", f"data_cache_dir={work}/cache",
            "max_seq_length=64", "per_device_batch_size=2", "learning_rate=1e-2", "warmup_steps=2",
            "logging_steps=1", "max_steps=12", "save_steps=6", f"zero_stage={stage}"]
    full = train(load_config(None, base + [f"output_dir={work}/a{stage}"]), log=lambda *a: None)
    resumed = train(load_config(None, base + [f"output_dir={work}/b{stage}",
                                              f"resume={work}/a{stage}/ckpt/step_6"]), log=lambda *a: None)
    results[stage] = {"full": full.losses, "resumed": resumed.losses}
import torch.distributed as dist  # noqa: E402

if dist.get_rank() == 0:
    with open(out_json, "w") as f:
        json.dump(results, f)
