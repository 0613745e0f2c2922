"""Two nodes on one machine: torchrun --nnodes 2 --nproc_per_node 1, one process per node, each in
its own working directory with its own SPECDRAFT_HOME and LOCAL_RANK 0, one rendezvous on
127.0.0.1, gloo. Code that takes LOCAL_RANK 0 for the global rank 0 would have both nodes write
the run's files; the run directory (output_dir) and the packed data cache (data_cache_dir) are
shared, as on a cluster's shared filesystem.

Every draft family x ZeRO-2 and ZeRO-3 (12 runs of 4 steps, a save after each; the families'
small drafts of tests/offline_runs.py, MTP on its own qwen3_next target), in 2 launches and this
process (tests/multinode_script.py runs every run in one process per rank or node):

1. one node, 2 ranks (helpers.torchrun): each run straight, the reference at 2 ranks;
2. two nodes: each run trains on both nodes, committing step 1, until one node's trainer is
   SIGKILLed while it saves step 2 (node 0 for every other run, node 1 for the rest); the same
   command on both nodes then resumes it (resume=auto);
3. here, 1 rank: each run straight (2 x 2 accumulation: the same global batch of 4), and each
   crashed run (a copy taken between the kill and the two-node resume) resumed on 1 rank.

The trainers of launch 2 are forked per job from one process per node that imported everything
once, so the 24 two-node jobs cost no start-up each; the whole module runs in ~2 minutes on 2
cores. The data cache is shared (data_cache_dir): rank 0 alone packs it, and every rank reads it.

What must hold: the two nodes log the one-node losses for steps 1-2, bit for bit; the killed save
is never committed and the other node's trainer stops with an error (it does not hang); the
resume on two nodes continues with the one-node run's losses, bit for bit, and the resume on 1 rank
with the 1-rank run's within the elastic tolerance of tests/test_distributed.py (another world
size adds in another order); node 1's process writes nothing but its own checkpoint shards, and
nothing lands in either node's working directory.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import (
    REPO,
    assert_every_update_moved_everything,
    assert_same_states,
    free_port,
    launch_env,
    run_overrides,
    torchrun,
    torchrun_command,
)
from offline_runs import SMALL, target_of
from specdraft.config import load_config
from specdraft.drafts.registry import FAMILIES
from specdraft.rundir.layout import FROZEN_FILE
from specdraft.train.loop import train

STAGES = (2, 3)
CASES = [(family, stage) for stage in STAGES for family in FAMILIES]
STEPS, KILL_STEP = 4, 2
ELASTIC_TOLERANCE = 1e-5  # as in tests/test_distributed.py
SCRIPT = REPO / "tests" / "multinode_script.py"
# what node 1 (rank 1) may write in a run directory: its own ZeRO shards of a slot, and that
# slot's directory (DeepSpeed's makedirs(exist_ok=True) before them)
RANK1_WRITES = re.compile(r"ckpt/step_\d+(/(bf16_)?zero_pp_rank_1_mp_rank_\d+_(optim|model)_states\.pt)?")


# how the survivor's trainer fails once its peer is SIGKILLed: the next collective (gloo) breaks,
# surfacing as torch.distributed's error type or our one-line error that names the rank it lost
PEER_LOST = re.compile(
    r"(DistBackendError|RuntimeError|SpecdraftError): .*(Connection|connection|peer|closed|Gloo|gloo)"
)


def name_of(family, stage) -> str:
    return f"{family}{stage}"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def plan(tiny_target_dir, mtp_target_dir, data_dir, work):
    ports = set()
    while len(ports) < 2 * len(CASES):
        ports.add(free_port())
    ports = sorted(ports)
    runs = []
    for family, stage in CASES:
        overrides = run_overrides(
            target_of(family, tiny_target_dir, mtp_target_dir),
            data_dir,
            None,  # each launch names the run's output_dir
            f"{work}/cache",
            per_device_batch_size=2,
            # rates 1/3, 2/3, 1: resumed from step 1, update 3 is the first whose rate comes from
            # the scheduler's loaded state (the optimizer's own brings back update 2's)
            warmup_steps=3,
            max_steps=STEPS,
            save_steps=1,
            zero_stage=stage,
            export_formats="[]",
            **{"draft.type": family},
            **SMALL.get(family, {}),
        )
        runs.append({"name": name_of(family, stage), "overrides": overrides, "ports": [ports.pop(), ports.pop()]})
    path = work / "plan.json"
    path.write_text(json.dumps({"runs": runs, "pause": 0.15, "kill_step": KILL_STEP}))
    return path


def result(work, name, job, rank):
    path = work / "results" / f"{name}.{job}.rank{rank}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.fixture(scope="module")
def one_node_results(plan, work):
    """{name: its result} of each run straight on one node, 2 ranks: losses, and the digests of
    the draft's weights and Adam moments after each update."""
    proc = torchrun(SCRIPT, "one_node", plan, work, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name_of(*case): result(work, name_of(*case), "one_node", 0) for case in CASES}


@pytest.fixture(scope="module")
def one_node(one_node_results):
    """{name: losses} of each run straight on one node, 2 ranks."""
    return {name: found["losses"] for name, found in one_node_results.items()}


@pytest.fixture(scope="module")
def two_nodes(plan, work, one_node):
    """Launch 2: both nodes' torchrun, one rendezvous (their output in WORK/node<N>.out, each
    trainer's in WORK/logs/)."""
    env = launch_env(TOKENIZERS_PARALLELISM="false")
    master_port, procs = free_port(), []
    for node in (0, 1):
        cwd = work / f"node{node}"
        cwd.mkdir()
        cmd = torchrun_command(SCRIPT, "nodes", plan, work, nproc=1, port=master_port, nodes=2, node_rank=node)
        with open(work / f"node{node}.out", "w") as out:  # a file, not a pipe: neither node blocks on it
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env=dict(env, SPECDRAFT_HOME=str(work / f"home{node}")),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        for proc in procs:
            proc.wait(timeout=500)
    finally:
        for proc in procs:
            if proc.poll() is None:  # torchrun's SIGTERM handler kills its worker's process group
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    for node, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {node}:\n{(work / f'node{node}.out').read_text()[-3000:]}"


@pytest.fixture(scope="module")
def one_rank(plan, work, two_nodes):
    """{name: (straight losses, resumed losses, resumed log)} on 1 rank, in this process."""
    out = {}
    for run in json.loads(plan.read_text())["runs"]:
        name, base = run["name"], run["overrides"]
        straight = train(
            load_config(None, [*base, f"output_dir={work}/one_rank/{name}", "gradient_accumulation_steps=2"]),
            log=lambda *a: None,
        ).losses
        lines = []
        resumed = train(load_config(None, [*base, f"output_dir={work}/crashed_copy/{name}"]), log=lines.append).losses
        out[name] = (straight, resumed, lines)
    return out


def metrics(run_dir):
    return [(row["step"], row["loss"]) for row in map(json.loads, open(run_dir / "metrics.jsonl"))]


def test_nothing_lands_in_a_nodes_working_directory(two_nodes, work):
    assert [list((work / f"node{node}").iterdir()) for node in (0, 1)] == [[], []]


@pytest.mark.parametrize("family, stage", CASES, ids=[f"{f}-zero{s}" for f, s in CASES])
def test_two_nodes_log_the_one_node_losses_and_a_node_killed_mid_save_never_commits_it(
    two_nodes, one_node, work, family, stage
):
    name = name_of(family, stage)
    killer = CASES.index((family, stage)) % 2
    report = result(work, name, "crash_report", killer)
    # killed while the save of step 2 had written files of its slot, before its commit
    assert report["killed"] and not report["slot_committed_at_kill"] and report["files"], report
    assert report["committed"] == ["step_1"]
    survivor = result(work, name, "crash_report", 1 - killer)
    assert survivor == {"exit": 1, "hung": False, "killer": killer}  # its next collective failed
    # and what failed was the collective with the dead peer (gloo's connection), not our own code
    error = result(work, name, "crash", 1 - killer)["error"]
    assert re.match(PEER_LOST, error), error
    # rank 0 logs each step before saving it: steps 1-2 of the killed job, then 2-4 of the resume
    straight = one_node[name]
    assert metrics(work / "crashed" / name) == [(1, straight[0]), (2, straight[1]), *enumerate(straight[1:], start=2)]


@pytest.mark.parametrize("family, stage", CASES, ids=[f"{f}-zero{s}" for f, s in CASES])
def test_the_crashed_run_resumes_on_two_nodes_with_the_one_node_losses(
    two_nodes, one_node_results, work, family, stage
):
    name = name_of(family, stage)
    straight = one_node_results[name]
    assert_every_update_moved_everything(straight["updates"])  # the resumed updates change what they load
    resumed = [result(work, name, "resumed", rank) for rank in (0, 1)]
    assert resumed[0]["losses"] == resumed[1]["losses"] == straight["losses"][KILL_STEP - 1 :]  # exact float equality
    for rank in (0, 1):  # updates 2-4 again: the weights and Adam's moments after each, bit for bit
        assert_same_states(resumed[rank]["updates"][1:], straight["updates"][KILL_STEP:])
    assert any(re.search(r"resumed from \S+/ckpt/step_1 at step 1$", line) for line in resumed[0]["log"])


@pytest.mark.parametrize("family, stage", CASES, ids=[f"{f}-zero{s}" for f, s in CASES])
def test_the_crashed_run_resumes_on_one_rank(one_rank, family, stage):
    straight, resumed, lines = one_rank[name_of(family, stage)]
    assert len(resumed) == STEPS - 1 == len(straight[1:]) and len(straight) == STEPS
    assert max(abs(a - b) for a, b in zip(resumed, straight[1:])) <= ELASTIC_TOLERANCE, (resumed, straight)
    assert any(line.endswith("at step 1") and "resumed from" in line for line in lines), lines


@pytest.mark.parametrize("family, stage", CASES, ids=[f"{f}-zero{s}" for f, s in CASES])
def test_node_1_writes_only_its_own_checkpoint_shards(two_nodes, work, family, stage):
    """Node 1's process has LOCAL_RANK 0 too: it must not write what only rank 0 writes (the slot's
    COMMITTED, `latest`, the exports, metrics, config.yaml, the data cache)."""
    name = name_of(family, stage)
    run_dir = (work / "crashed" / name).resolve()
    for job, first_commit in (("crash", 1), ("resumed", KILL_STEP)):
        for rank in (0, 1):
            found = result(work, name, job, rank)
            if found is None:  # the trainer killed in that job
                continue
            writes = sorted({Path(p) for p in found["writes"]})
            if rank == 1:
                assert writes and all(p.is_relative_to(run_dir) for p in writes), (job, writes)
                relative = [p.relative_to(run_dir).as_posix() for p in writes]
                assert all(RANK1_WRITES.fullmatch(p) for p in relative), (job, relative)
                assert any(p.endswith("_states.pt") for p in relative), (job, relative)
            else:  # what rank 1 must not write, the spy sees rank 0 write
                expected = {
                    run_dir / f"ckpt/step_{first_commit}/COMMITTED",
                    run_dir / f"ckpt/step_{first_commit}/{FROZEN_FILE}",  # safetensors' own writer
                    run_dir / "ckpt/latest",
                    run_dir / "metrics.jsonl",
                }
                assert expected <= set(writes), (job, writes)


def test_a_rank_that_cannot_see_the_packed_data_stops_every_rank_in_one_line(tiny_target_dir, data_dir, tmp_path):
    """A node whose data cache is on its own disk (no shared data_cache_dir): rank 0 packs the data
    where rank 1 cannot see it. Both ranks exit 2 with the one-line reason; neither waits forever."""
    (tmp_path / "train.yaml").write_text("learning_rate: 1.0e-2\n")
    proc = torchrun(REPO / "tests" / "node_local_cache_script.py", tiny_target_dir, data_dir, tmp_path, timeout=180)
    assert proc.returncode != 0, proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("specdraft: error: ")]
    assert errors and all("rank 1 cannot see the packed data rank 0 built there" in line for line in errors), (
        proc.stderr[-3000:]
    )
    assert "/specdraft/" not in proc.stderr, proc.stderr[-3000:]  # torchrun's own ChildFailedError trace only
