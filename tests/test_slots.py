"""specdraft/checkpoint/slots.py at the unit level, on a slot of plain files (no training): the
commit's order of fsyncs and writes, and what verification refuses. The whole save and resume are
pinned end to end in tests/test_checkpoint.py; these pin what only a power loss or a planted file
would show (issue 55, item 7)."""

import json
import os

import pytest
import torch

from specdraft.checkpoint import slots
from specdraft.errors import SpecdraftError
from specdraft.rundir.layout import COMMITTED, LATEST


def written_slot(ckpt_dir):
    """step_4/ holding what one rank's DeepSpeed wrote (fsynced and hashed: its manifest) and a
    file DeepSpeed copies besides its states (in no rank's manifest)."""
    slot = ckpt_dir / "step_4"
    slot.mkdir(parents=True)
    torch.save({"module": torch.zeros(2)}, slot / "mp_rank_00_model_states.pt")
    (slot / "zero_to_fp32.py").write_text("# copied\n")
    return slot, {"mp_rank_00_model_states.pt": slots.file_entry(slot / "mp_rank_00_model_states.pt")}


def test_commit_syncs_the_slot_before_its_marker_and_the_marker_before_latest(tmp_path, monkeypatch):
    """fsync(every file rank 0 adds) and fsync(slot dir) -> COMMITTED -> `latest`: a power loss
    never leaves a COMMITTED whose directory entries or files are not on disk."""
    ckpt = tmp_path.resolve() / "ckpt"
    slot, manifest = written_slot(ckpt)
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"-> {b}"), real_replace(a, b)))
    slots.commit_slot(slot, [manifest], {"step": 4}, pause=lambda: None)
    marker = events.index(f"-> {slot / COMMITTED}")
    assert str(slot / "zero_to_fp32.py") in events[:marker] and str(slot) in events[:marker], events
    assert events.index(f"-> {ckpt / LATEST}") > marker
    assert set(slots.verify_slot(slot)["files"]) == {"mp_rank_00_model_states.pt", "zero_to_fp32.py"}


def test_verification_refuses_a_file_no_commit_listed(tmp_path):
    """A file planted in a committed slot (the offline commands read every file of it): refused
    in one line, before anything reads it."""
    slot, manifest = written_slot(tmp_path / "ckpt")
    slots.commit_slot(slot, [manifest], {"step": 4}, pause=lambda: None)
    (slot / "extra_states.pt").write_bytes(b"planted")
    with pytest.raises(SpecdraftError, match=r"extra_states\.pt: not in the COMMITTED manifest"):
        slots.verify_slot(slot)


def test_verification_refuses_a_listed_file_that_is_gone_in_one_line(tmp_path):
    """A SpecdraftError (resume=auto moves such a slot aside and takes the one before), not a
    FileNotFoundError's traceback."""
    slot, manifest = written_slot(tmp_path / "ckpt")
    slots.commit_slot(slot, [manifest], {"step": 4}, pause=lambda: None)
    (slot / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(SpecdraftError, match=r"mp_rank_00_model_states\.pt: listed in COMMITTED but missing"):
        slots.verify_files(slot, json.loads((slot / COMMITTED).read_text()), ["mp_rank_00_model_states.pt"])
