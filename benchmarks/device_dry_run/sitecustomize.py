"""The device check's dry run: let Python import only what the lent GPU machine has.

Loaded at start-up by every interpreter of the dry run (the ranks it launches too), through
``PYTHONPATH``, when ``ADVISOR_DEVICE_PACKAGES`` names the machine's package list.  A module
may come from the standard library, the advisor's own tree, the carried wheels
(``ADVISOR_DEVICE_SITE``), or a distribution on that list; any other import fails loudly,
naming the module and its distribution, as it would there.  Written here because no library
simulates another machine's site-packages; a meta-path finder is the hook Python offers.
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import sys


class DeviceOnly(importlib.abc.MetaPathFinder):
    def __init__(self, packages: set, allowed_dirs: list) -> None:
        self.packages, self.allowed_dirs = packages, allowed_dirs
        self.owners = None  # top-level module -> distributions, read on first need

    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname or fullname.startswith("_") or fullname in sys.stdlib_module_names \
                or fullname in sys.builtin_module_names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname)
        if spec is None:
            return None  # missing here too: the ordinary error says so
        where = spec.origin or next(iter(spec.submodule_search_locations or []), "")
        if any(os.path.realpath(where).startswith(d) for d in self.allowed_dirs):
            return None
        if self.owners is None:
            self.owners = importlib.metadata.packages_distributions()
        owners = {_canonical(d) for d in self.owners.get(fullname, [])}
        if owners & self.packages:
            return None
        # a package vendored inside an allowed one (setuptools/_vendor/jaraco) comes with it
        inside = {_canonical(d) for part in os.path.dirname(where).split(os.sep) for d in self.owners.get(part, [])}
        if not owners and inside & self.packages:
            return None
        raise ModuleNotFoundError(
            f"dry run: {fullname!r} ({', '.join(sorted(owners)) or 'no known distribution'}) is not on the device "
            "machine and not among the carried wheels: add it to benchmarks/device_wheels.py's set (make "
            "device-wheels), or do not import it", name=fullname)


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _install() -> None:
    listing = os.environ.get("ADVISOR_DEVICE_PACKAGES")
    if not listing:
        return
    with open(listing) as fh:
        packages = {_canonical(line.strip()) for line in fh if line.strip() and not line.startswith("#")}
    root = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
    # the advisor's own packages, not the whole tree: a virtual environment may live inside it
    own = [os.path.join(root, d) + os.sep for d in ("advisor", "profilers", "policies", "tests", "benchmarks",
                                                    "examples")]
    site = os.environ.get("ADVISOR_DEVICE_SITE")
    dirs = own + ([os.path.realpath(site) + os.sep] if site else [])
    sys.meta_path.insert(0, DeviceOnly(packages, dirs))


_install()
