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


# Each first-party module is imported first in a process of its own, forked from one that holds
# only the third-party packages: an import cycle among ours shows whatever the order, and torch
# is imported once, not once per module.
FIRST_IMPORTS = """
import os, sys, traceback
import click, numpy, optuna, rich, sklearn.linear_model, torch, torch.distributed
children = {}
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(module)
        except BaseException:
            print("import " + module + ":", file=sys.stderr)
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    children[pid] = module
print(" ".join(module for pid, module in children.items() if os.waitpid(pid, 0)[1] != 0))
"""


def test_any_package_can_be_imported_first():
    modules = ("profilers.profile", "policies.problem", "advisor.runtime.timing", "advisor.testbed.launch",
               "advisor.tuning.online", "advisor.cli")
    done = subprocess.run([sys.executable, "-c", FIRST_IMPORTS, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr[-3000:]


#: the layers below the package root's re-exports: none may import the root (``import advisor``,
#: ``from advisor import ...``), which would load the layers above them
LOWER = ("profilers", "policies", "advisor/core", "advisor/compressors", "advisor/runtime", "advisor/perfmodel",
         "advisor/report", "advisor/tuning")


def test_no_lower_layer_imports_the_package_root():
    import ast

    offenders = []
    for folder in LOWER:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                if "advisor" in names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_importing_a_lower_layer_loads_nothing_above_it():
    check = ("import sys, profilers, policies, advisor.core.documents\n"
             "print(sorted(m for m in sys.modules if m.startswith(('advisor.tuning', 'advisor.testbed', "
             "'advisor.integrations', 'advisor.cli'))))")
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-3000:]


def test_the_package_root_offers_every_name_it_lists():
    import advisor

    assert set(advisor.__all__) <= set(dir(advisor))
    for name in advisor.__all__:
        assert getattr(advisor, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        advisor.nope  # noqa: B018
