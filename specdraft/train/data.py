"""The training data of a run: tokenised and packed once by rank 0 into the cache every rank then
memory-maps."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specdraft.config import resolve_data_files
from specdraft.data.packing import PackedData, build_packed_cache, open_packed_cache, packed_cache_dir
from specdraft.data.whole_packing import WholePackedData
from specdraft.rundir.shared_fs import wait_visible
from specdraft.errors import SpecdraftError
from specdraft.parallel.collectives import any_rank, run_shared


def prepare_data(cfg: DictConfig, tokenizer, rank: int, log) -> PackedData:
    """Rank 0 tokenises and packs into the cache (once per inputs); every rank memory-maps it. A
    rank that cannot read the data files or see the cache (another node's disk) stops every rank
    in one line instead of leaving them waiting."""
    # each rank names the cache from its own view of the files (their sizes and times)
    files, cache_dir = run_shared(lambda: data_files_and_cache(cfg), on_rank=None)
    error = None
    if rank == 0:
        try:
            build_packed_cache(
                files, tokenizer, cfg.max_seq_length, cache_dir, log, thinking=cfg.thinking, strict=cfg.data_strict
            )
        except Exception as err:  # re-raised below on every rank, so no rank hangs at the barrier
            error = err
    failed = any_rank(error is not None)
    if error is not None:
        raise error
    if failed:
        raise SystemExit(2)  # rank 0 reports the data error
    run_shared(lambda: _expect_cache(cache_dir, rank), on_rank=None)
    packed = open_packed_cache(cache_dir)
    if cfg.packing == "whole":  # the same files, windows of whole conversations
        whole = WholePackedData(cache_dir, packed.meta)
        log(f"data: {whole.describe()}")
        return whole
    return packed


def data_files_and_cache(cfg: DictConfig):
    """The data files a config names and the packed cache they are kept in (keyed by files, tokenizer, window)."""
    files = resolve_data_files(cfg.data_files)
    return files, packed_cache_dir(files, cfg.target, cfg.max_seq_length, cfg.thinking, cfg.data_cache_dir)


def _expect_cache(cache_dir: Path, rank: int) -> None:
    if not wait_visible(Path(cache_dir) / "meta.json"):
        raise SpecdraftError(
            f"{cache_dir}: rank {rank} cannot see the packed data rank 0 built there: set "
            f"data_cache_dir to a directory every node shares, or run `specdraft data CONFIG` "
            f"on every node first"
        )
