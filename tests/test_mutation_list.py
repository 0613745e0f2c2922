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
