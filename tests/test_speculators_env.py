"""The speculators venv that export tests rely on is there and loads the classes they use."""

import pytest

from speculators_env import PYTHON_ENV_VAR, require_speculators_python, run_in_speculators

VERSIONS_SCRIPT = """
import json, importlib.metadata as md
from speculators.model import SpeculatorModel
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
print(json.dumps({
    "versions": {name: md.version(name) for name in ("speculators", "torch", "transformers")},
    "registry": {name: SpeculatorModel.registry[name].__name__ for name in ("eagle3", "dflash")},
    "configs": [Eagle3SpeculatorConfig().speculators_model_type,
                DFlashSpeculatorConfig().speculators_model_type],
}))
"""


def test_speculators_venv_imports_eagle3_and_dflash():
    out = run_in_speculators(VERSIONS_SCRIPT)
    assert out["versions"]["speculators"] == "0.9.0"
    assert out["versions"]["torch"].split("+")[0] == "2.13.0"
    assert out["versions"]["transformers"].startswith("5.")
    # from_pretrained dispatches on speculators_model_type through this registry
    assert out["registry"] == {"eagle3": "Eagle3DraftModel", "dflash": "DFlashDraftModel"}
    assert out["configs"] == ["eagle3", "dflash"]


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
def test_missing_speculators_venv_fails_in_ci_and_skips_elsewhere(monkeypatch, tmp_path, ci, outcome):
    monkeypatch.setenv(PYTHON_ENV_VAR, str(tmp_path / "absent" / "python"))
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="make speculators-venv"):
        require_speculators_python()


def test_every_test_reaches_the_speculators_venv_through_this_module():
    """A test file with its own lookup of the venv skips silently where it is missing, CI included
    (tests/test_dflash_export.py did): only speculators_env.py reads the variable or names the venv."""
    import re
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    for path in sorted(tests.glob("*.py")):
        if path.name in ("speculators_env.py", Path(__file__).name):
            continue
        code = path.read_text()
        assert not re.search(
            rf"environ[^\n]*{PYTHON_ENV_VAR}|[\"']\.venv-speculators[\"']|def speculators_python", code
        ), path.name
