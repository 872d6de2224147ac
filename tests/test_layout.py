"""The package layout: arrows point down, and advisor/ holds only its subpackages."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SUBPACKAGES = {"core", "compressors", "runtime", "perfmodel", "report", "tuning", "testbed", "integrations"}


def test_advisor_holds_its_subpackages_and_only_init_and_cli_beside_them():
    entries = {p.name for p in (ROOT / "advisor").iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert entries == SUBPACKAGES | {"__init__.py", "cli.py"}, entries ^ (SUBPACKAGES | {"__init__.py", "cli.py"})


@pytest.mark.skipif(shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None,
                    reason="import-linter is not installed (it comes with the test extras)")
def test_every_import_points_down_the_layers():
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]


def test_any_package_can_be_imported_first():
    modules = ("profilers.profile", "policies.problem", "advisor.runtime.timing", "advisor.testbed.launch",
               "advisor.tuning.online", "advisor.cli")
    # one fresh interpreter each, all at once: each import is mostly torch's, on its own core
    running = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for m in modules}
    for module, process in running.items():
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, f"import {module}: {err[-1500:]}"
