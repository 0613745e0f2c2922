"""A few of `make mutation`'s mutants, run with `make test` (issue 55, item 7): one or more per
package the mutation lists cover, the three resume-loading ones among them, each against its
fastest killing test, so that a kill cannot rot between two runs of `make mutation`.

Each mutant is applied to one copy of the tree (tests/mutation/run.py's machinery) and its killing
test runs there in a fork of one process that has imported torch, transformers and DeepSpeed once
(what would otherwise cost each run ~10 s of CPU). The killing tests pass unmutated in the suite
itself. The forks reuse this session's tiny target and data (SPECDRAFT_TEST_CACHE).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mutation"))

import run as mutation_run  # noqa: E402
from mutations import all_mutations  # noqa: E402

CORE = "tests/test_capture_architectures.py::test_the_core_applies_window_sinks_and_softcap_inside_documents"
RESUME = "tests/test_checkpoint.py::test_a_resume_brings_back_the_weights_the_optimizer_and_the_schedule"
# mutation name -> its fastest killing test (one of the mutation's tests, or one inside its test files)
IN_SUITE = {
    # checkpoint/
    "loading/resume-without-the-weights": RESUME,
    "loading/resume-without-the-optimizer-state": RESUME,
    "loading/resume-without-the-scheduler-state": RESUME,
    "slots/verify-accepts-files-outside-the-manifest": (
        "tests/test_slots.py::test_verification_refuses_a_file_no_commit_listed"
    ),
    # rundir/, data/, target/, decode/, drafts/, train/, parallel/, export/
    "rundir/write-in-place": (
        "tests/test_rundir.py::test_write_atomic_replaces_the_file_and_never_writes_into_the_old_one"
    ),
    "sampler/resume-one-batch-late": "tests/test_data.py::test_sampler_shards_are_disjoint_and_resume_exactly",
    "target-attention/tile-window-plus-1": f"{CORE}[24-None-None-slices]",
    "tree/parent-only-mask": "tests/test_decode.py::test_tree_pass_gives_each_node_the_logits_of_its_own_path",
    "eagle3/ttt-label-shift": "tests/test_eagle3.py::test_vectorised_ttt_equals_the_per_position_reference[default]",
    "eagle3/packed-conversations-see-each-other": (
        "tests/test_eagle3.py::test_a_conversation_packed_after_another_computes_what_it_computes_alone"
    ),
    "targets/window-tile-ignored": "tests/test_memory.py::test_a_windowed_layers_attention_is_bounded_by_its_window",
    "glide/loss-normaliser": (
        "tests/test_glide_semantics.py::test_loss_logits_and_gradients_equal_the_per_position_reference"
        "[lag=1-positions=plain-kv_heads=2]"
    ),
    "imports/no-shape-check": (
        "tests/test_imports.py::test_a_wrong_shape_or_a_missing_tensor_is_one_line_naming_it[glide-native]"
    ),
}
# packages whose mutants all need minutes-long killers: `make mutation` alone runs them
SLOW_ONLY = {"commands"}
MUTATIONS = {m.name: m for m in all_mutations()}


def package(mutation) -> str:
    return Path(mutation.file).parts[1]


def test_every_package_the_mutations_cover_has_one_here():
    covered = {package(m) for m in MUTATIONS.values()}
    assert covered - SLOW_ONLY <= {package(MUTATIONS[name]) for name in IN_SUITE}


def selected(tests):
    """The pytest arguments that select tests (not those of --deselect, -k, -m)."""
    after_flag = [i + 1 for i, arg in enumerate(tests) if arg in ("--deselect", "-k", "-m")]
    return [arg for i, arg in enumerate(tests) if i not in after_flag and not arg.startswith("-")]


@pytest.mark.parametrize("name", IN_SUITE)
def test_the_killer_is_one_of_the_mutations_own_tests(name):
    killer, tests = IN_SUITE[name], selected(MUTATIONS[name].tests)
    assert any(killer == arg or killer.startswith(f"{arg}::") for arg in tests), (killer, tests)


@pytest.fixture(scope="module")
def verdicts(tiny_assets):
    home = tiny_assets[0].parents[1]  # <home>/tiny/target: every fork reuses this session's build
    return mutation_run.kill_checks(IN_SUITE, timeout=300, env={"SPECDRAFT_TEST_CACHE": str(home)})


@pytest.mark.parametrize("name", IN_SUITE)
def test_the_mutant_fails_its_killing_test(verdicts, name):
    found = verdicts[name]
    assert found.status == "killed" and found.killer == IN_SUITE[name], found.detail
