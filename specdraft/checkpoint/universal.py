"""DeepSpeed's universal checkpoint format: how a slot saved at one world size or ZeRO stage is
loaded at another. ds_to_universal converts it; the repairs below make the copy load at every stage
1-3; a copy is made once (by rank 0), committed like a slot and reused by the next resume."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from specdraft.rundir.atomic import publish_dir, write_atomic
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import COMMITTED, draft_part, universal_dir
from specdraft.checkpoint import safe_load
from specdraft.parallel.collectives import run_shared
from specdraft.checkpoint.slots import file_entry, file_sha256, read_commit, remove_slot, slot_files, verify_slot

MODEL_STATES_BY_STAGE = {False: "mp_rank_00_model_states.pt", True: "zero_pp_rank_0_mp_rank_00_model_states.pt"}


def convert_to_universal(slot_dir: Path, out_dir: Path) -> None:
    """DeepSpeed's ds_to_universal, in-process (one worker: no process pool), of a verified slot.

    ds_to_universal writes `latest_universal` into the PARENT of its output folder, so it writes
    into a private temp parent; the result is committed like a slot and renamed into place.
    """
    from deepspeed.checkpoint import ds_to_universal

    tmp_parent = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_parent, ignore_errors=True)
    tmp_parent.mkdir(parents=True)  # a draft's copy of a several-draft slot: step_<N>.universal/<name>
    tmp = tmp_parent / out_dir.name
    args = argparse.Namespace(
        input_folder=str(slot_dir),
        output_folder=str(tmp),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise SpecdraftError(
            f"{slot_dir}: DeepSpeed's universal conversion failed ({type(err).__name__}: {first})"
        ) from err
    _serve_every_stage(tmp)
    files = {str(p.relative_to(tmp)): file_entry(p) for p in slot_files(tmp)}
    record = {"source": slot_dir.name, "source_commit": file_sha256(commit_of(slot_dir)), "files": files}
    write_atomic(tmp / COMMITTED, json.dumps(record, indent=1))
    publish_dir(tmp, out_dir)
    shutil.rmtree(tmp_parent)


def _serve_every_stage(out: Path) -> None:
    """ds_to_universal writes a ZeRO-1/2 slot and a ZeRO-3 slot differently, and each stage's loader
    reads only its own form: fill in what the other stage reads, so the copy loads at any stage 1-3.

    - module states: the loader looks for the file name its own stage writes (ZeRO-3: per rank);
    - zero/optimizer_state.pt: ZeRO-3 reads the step and hyperparameters from a torch optimizer
      state dict in it, ZeRO-1/2 reads `param_groups` and `ds_version`;
    - zero/<param>/*.pt: ZeRO-1/2 reads {"param": tensor} and a step.pt, ZeRO-3 writes bare tensors.
    """
    import deepspeed

    present = [name for name in MODEL_STATES_BY_STAGE.values() if (out / name).is_file()]
    for name in MODEL_STATES_BY_STAGE.values():
        if not (out / name).is_file():
            shutil.copyfile(out / present[0], out / name)
    zero = out / "zero"
    optim = safe_load.load(zero / "optimizer_state.pt")
    params = sorted(p for p in zero.iterdir() if p.is_dir())
    # ds_to_universal writes a folder per buffer too (fp32.pt only); they are never loaded
    # (buffers come back from FROZEN_FILE), and at ZeRO-1/2 the step is read from a parameter's
    trained = [p for p in params if (p / "exp_avg.pt").is_file()]
    if "optimizer_state_dict" in optim:  # from ZeRO-3
        step = optim["optimizer_state_dict"]["state"][0]["step"]
        for param in params:
            for path in param.glob("*.pt"):
                state = torch.load(path, weights_only=True)
                if torch.is_tensor(state):
                    torch.save({"param": state}, path)
            torch.save(torch.as_tensor(step), param / "step.pt")
        optim.setdefault("ds_version", deepspeed.__version__)
    else:  # from ZeRO-1/2
        step = torch.load(trained[0] / "step.pt", weights_only=True)
        optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
    torch.save(optim, zero / "optimizer_state.pt")


def commit_of(source: Path) -> Path:
    """The COMMITTED that covers a slot, or a draft's folder of a several-draft slot."""
    return source / COMMITTED if (source / COMMITTED).is_file() else source.parent / COMMITTED


def universal_copy(
    slot_dir: Path, ckpt_dir: Path, log: Callable[[str], None], where: str, name: Optional[str] = None
) -> Path:
    """Collective: the slot's universal copy (of draft `name` of a several-draft slot), made once
    by rank 0 (or reused when it verifies), then verified by every rank before loading.
    ckpt_dir: the resuming run's own checkpoint directory, where the copy is written: a slot of
    another run is only read (it may be read-only, or shared). where: "N rank(s) at ZeRO-S"."""
    out = draft_part(universal_dir(Path(ckpt_dir) / slot_dir.name), name)
    record = read_commit(slot_dir)
    slot_dir = draft_part(slot_dir, name)
    saved = f"saved with {record['world_size']} rank(s) at ZeRO-{record['zero_stage']}"

    def ensure():
        if (out / COMMITTED).is_file():
            try:
                if read_commit(out).get("source_commit") != file_sha256(commit_of(slot_dir)):
                    raise SpecdraftError(f"{out}: converted from another {slot_dir.name}")
                verify_slot(out)
                log(f"resume: reusing {out} ({saved})")
                return
            except SpecdraftError as err:
                log(f"resume: {err}; converting again")
                remove_slot(out)
        started = time.perf_counter()
        convert_to_universal(slot_dir, out)
        log(
            f"resume: converted {slot_dir.name} ({saved}) to DeepSpeed's universal format in "
            f"{time.perf_counter() - started:.1f} s for {where}: {out}"
        )

    run_shared(ensure)
    run_shared(lambda: verify_slot(out), on_rank=None)  # every rank reads every fragment
    return out
