"""Run on 2 ranks by tests/test_offline_commands.py: every draft family trained at ZeRO-2 (4 steps,
saving at 2 and 4), then resumed from step 2 at the same size; and the same for one run of every
family at once (SEVERAL). Writes {family: {"full": losses, "resumed": losses}} ({name: losses}
for SEVERAL) for the tests, which run the offline commands on these runs afterwards."""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 collective renames, every step

from offline_runs import SEVERAL, run_config, target_of  # noqa: E402
from specdraft.drafts.registry import FAMILIES  # noqa: E402
from specdraft.train.loop import train  # noqa: E402

target, mtp_target, data_dir, work, out_json = sys.argv[1:6]
results = {}
for family in [*FAMILIES, SEVERAL]:
    family_target = target_of(family, target, mtp_target)
    full = train(run_config(family_target, data_dir, work, family, family), log=lambda *a: None)
    resumed = train(
        run_config(family_target, data_dir, work, family, f"{family}_resumed", f"resume={work}/{family}/ckpt/step_2"),
        log=lambda *a: None,
    )
    results[family] = {"full": full.losses or full.draft_losses, "resumed": resumed.losses or resumed.draft_losses}
if int(os.environ["RANK"]) == 0:
    with open(out_json, "w") as f:
        json.dump(results, f)
