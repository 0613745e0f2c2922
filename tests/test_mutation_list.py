"""The mutation list stays in step with the code: every snippet is found exactly once.

`make mutation` runs the mutants (slow); this cheap check runs with `make test`, so a refactor that
moves a mutated snippet says so at once instead of leaving the mutation check to rot.
"""

import sys
from pathlib import Path

import pytest

MUTATION_DIR = Path(__file__).resolve().parent / "mutation"
sys.path.insert(0, str(MUTATION_DIR))

from mutations import all_mutations  # noqa: E402
from run import REPO, check_snippet  # noqa: E402

MUTATIONS = all_mutations()


def test_mutation_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_to_the_current_code(mutation):
    assert check_snippet(REPO, mutation) == ""
    for arg in mutation.tests:  # the tests it names exist (a renamed test would pass vacuously)
        if arg.startswith("tests/"):
            path, _, test = arg.partition("::")
            assert (REPO / path).is_file(), arg
            if test:
                assert f"def {test.split('[')[0]}(" in (REPO / path).read_text(), arg


def test_the_killing_test_is_read_from_pytests_failure_line():
    """`make mutation` re-runs each killing test unmutated: it must read the node id exactly."""
    import run as runner

    assert (
        runner.killing_test("FAILED tests/a.py::test_b[x-y] - AssertionError: a - b\nFAILED tests/c.py::d")
        == "tests/a.py::test_b[x-y]"
    )
    assert runner.killing_test("(whole suite) ERROR tests/a.py::test_e - RuntimeError") == "tests/a.py::test_e"
    assert runner.killing_test("") == ""
    assert runner.killing_test("Fatal Python error: Aborted\n1 failed") == ""  # a crash names no test


# -- the runner's verdicts (tests/mutation/run.py's verdict / trusted / report: no test is run) ----

TESTS = ("tests/a.py", "-k", "fast")


def test_a_run_that_times_out_kills_nothing():
    """A hang proves nothing about the mutant (nor does the whole suite's): its own status."""
    import run as runner

    assert runner.verdict(TESTS, ("timeout", 600.0, "")).status == "timeout"
    suite_hangs = runner.verdict(TESTS, ("passed", 5.0, ""), ("timeout", 2400.0, "last lines"))
    assert suite_hangs.status == "timeout" and suite_hangs.recheck == ()


def test_passing_runs_let_the_mutant_survive():
    import run as runner

    assert runner.verdict(TESTS, ("passed", 5.0, "1 passed")).status == "survived"
    assert runner.verdict(TESTS, ("passed", 5.0, ""), ("passed", 900.0, "")).status == "survived"


def test_a_kill_is_rechecked_by_the_test_it_names_else_by_the_run_that_failed():
    """Unmutated, the re-check reruns what actually killed the mutant: the named test; without
    one (a crash), its own tests when they failed, the whole suite when that was what failed
    (its own tests, which it survived, would pass and vouch for nothing)."""
    import run as runner

    named = runner.verdict(TESTS, ("failed", 5.0, "FAILED tests/a.py::test_b - AssertionError"))
    assert (named.status, named.killer, named.recheck) == ("killed", "tests/a.py::test_b", ("tests/a.py::test_b",))
    by_suite = runner.verdict(TESTS, ("passed", 5.0, ""), ("failed", 900.0, "FAILED tests/c.py::test_d"))
    assert (by_suite.killer, by_suite.recheck) == ("tests/c.py::test_d", ("tests/c.py::test_d",))
    assert by_suite.detail.startswith("(whole suite) ")
    own_crash = runner.verdict(TESTS, ("failed", 5.0, "Fatal Python error: Segmentation fault"))
    assert (own_crash.status, own_crash.killer, own_crash.recheck) == ("killed", "", TESTS)
    suite_crash = runner.verdict(TESTS, ("passed", 5.0, ""), ("failed", 900.0, "Killed"))
    assert (suite_crash.status, suite_crash.recheck) == ("killed", runner.WHOLE_SUITE)


def test_a_kill_whose_recheck_fails_unmutated_is_a_broken_test():
    import run as runner

    kill = runner.verdict(TESTS, ("passed", 5.0, ""), ("failed", 900.0, "Killed"))
    assert runner.trusted(kill, {TESTS}).status == "killed"  # another recheck failed
    assert runner.trusted(kill, {runner.WHOLE_SUITE}).status == "broken-test"
    survivor = runner.verdict(TESTS, ("passed", 5.0, ""))
    assert runner.trusted(survivor, {()}).status == "survived"


@pytest.mark.parametrize(
    "statuses, code",
    [(["killed"], 0), (["killed", "timeout"], 1), (["survived"], 1), (["error"], 1), (["broken-test"], 1)],
)
def test_anything_but_kills_fails_the_run_and_is_listed(statuses, code, capsys):
    import run as runner

    names = [MUTATIONS[i] for i in range(len(statuses))]
    assert runner.report(names, [runner.Verdict(status, "") for status in statuses], 1.0) == code
    out = capsys.readouterr().out
    if "timeout" in statuses:
        assert f"TIMEOUT:     {names[1].name}" in out and "1 timed out" in out


def test_a_pytest_run_is_read_as_passed_or_failed_with_its_failing_lines():
    import run as runner

    output = "....F\nFAILED tests/a.py::test_b - x\nERROR tests/c.py - ImportError\n1 failed, 4 passed\n"
    assert runner.summarize(False, output) == (
        "failed",
        "FAILED tests/a.py::test_b - x\nERROR tests/c.py - ImportError",
    )
    assert runner.summarize(True, "a\nb\nc\n4 passed in 1s\n") == ("passed", "b\nc\n4 passed in 1s")
