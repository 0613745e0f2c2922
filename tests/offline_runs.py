"""The runs tests/test_offline_commands.py makes of every draft family (shared with its 2-rank
script): global batch 4 = 2 ranks x 2 (or 1 rank x 2 x 2 accumulation after an elastic resume)."""

import json

from helpers import run_overrides
from specdraft.config import load_config
from specdraft.drafts.registry import FAMILIES

# Only what makes a family's draft small enough for a CPU test; a family missing here trains
# with its defaults (and is still tested).
SMALL = {
    "eagle3": {"draft.ttt_steps": 2, "draft.draft_vocab_size": 200},
    "dflash": {"draft.num_layers": 1, "draft.block_size": 4, "draft.max_anchors": 16},
    "dspark": {"draft.num_layers": 1, "draft.block_size": 4, "draft.max_anchors": 16, "draft.markov_rank": 8},
    "peagle": {"draft.num_depths": 3, "draft.draft_vocab_size": 200, "draft.mask_token_id": 3},
}
STEPS, SAVE_STEPS = 4, 2
# a family that drafts only for targets of its own kind trains on one (MTP: the tiny qwen3_next
# with an MTP layer, tests/helpers.qwen3_next_mtp_target)
OWN_TARGET = {"mtp"}


def target_of(family, target, mtp_target):
    return mtp_target if family in OWN_TARGET else target


SEVERAL = "several"  # the run of every family at once (`drafts:`, one per family, named by it)
# the families a several-draft run trains on the Llama target: those that draft for it
SEVERAL_FAMILIES = [family for family in FAMILIES if family not in OWN_TARGET]


def run_config(target, data_dir, work, family, name, *extra):
    """family: a draft family, or SEVERAL: one run training every family's draft (each named by its
    family), configured as each family's own run."""
    if family == SEVERAL:
        sections = {
            f: dict({"type": f}, **{k[len("draft.") :]: v for k, v in SMALL.get(f, {}).items()})
            for f in SEVERAL_FAMILIES
        }
        options = [f"drafts={json.dumps(sections)}"]
    else:
        options = [f"draft.type={family}", *(f"{k}={v}" for k, v in SMALL.get(family, {}).items())]
    overrides = run_overrides(
        target,
        data_dir,
        f"{work}/{name}",
        f"{work}/cache",
        per_device_batch_size=2,
        max_steps=STEPS,
        save_steps=SAVE_STEPS,
        zero_stage=2,
    )
    return load_config(None, [*overrides, *options, *extra])
