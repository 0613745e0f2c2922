"""`specdraft regenerate`: the target writes the answers of a training set.

    specdraft regenerate --target DIR --data GLOB --out DIR [--backend hf|openai] ...

Every assistant turn of every row is replaced by the target's own answer, conditioned on its own
earlier answers (a row ending in a user turn, or holding only a prompt, gets one appended). The
output directory holds what `specdraft train` reads directly:

    OUT/shard-r<rank>-<run>-<k>.jsonl   rows {"id", "sample", "file", "source", "conversations"};
                                        each regenerated assistant turn carries its "token_ids", and
                                        "truncated": true when cut at its budget (finish=length:
                                        training learns no end-of-turn after it)
    OUT/manifest.json                   sources, target identity, backend, sampling (written before
                                        the first shard, checked by every rerun), then counts
    OUT/errors[-r<rank>].jsonl          this run's rows without an answer, with the reason and kind:
                                        "failed" (the server did not answer) or "skipped" (the row
                                        itself: template refused, too long, empty answer, duplicate)

Resume is keyed by (source file, row id) and sample index; the row id is its "id" field, else a
hash of its content. A row is written only once it is complete, a shard appears whole (written
atomically) or not at all, so a rerun after any crash writes exactly the rows no shard holds yet,
each once. Error rows of both kinds are asked again by the next run. Failed rows make the command
exit 1 (so `regenerate && train` stops); skipped rows do not (a rerun would skip them again).

Ctrl-C (SIGINT) or SIGTERM: the rows finished so far are written, the manifest counts them, one line
says so, and the command exits 130 (143 for SIGTERM); the same command resumes after them.
Under torchrun (RANK / WORLD_SIZE) each rank takes the rows its ids hash to; global rank 0 alone
writes manifest.json, its counts once every rank has finished (ranks.py).

Its parts: run.py (the run: config, rows through the backend, the manifest), rows.py (which rows a
rank owns, each row turn by turn), backends.py (requests, answers, transformers' generate),
openai_backend.py (OpenAI-compatible servers), ranks.py (signals and ranks), writer.py (shards).
"""

from specdraft.regenerate.run import RegenerateConfig, load_regenerate_config, regenerate

__all__ = ["RegenerateConfig", "load_regenerate_config", "regenerate"]
