"""The wheels the lent GPU machine needs to run the advisor: fetch them here, and check the set is complete.

That machine reaches no network, and its ``python3`` (CPython 3.12, x86-64) has most of what
the advisor imports, not all (``benchmarks/device_packages.txt`` lists what it has).  This
finds the advisor's runtime requirements, with everything they require in turn, as they are
installed in this environment (the versions the tests ran with), leaves out what the machine
has, and fetches the rest as CPython 3.12 manylinux wheels into ``.whl/`` (git-ignored):

    python benchmarks/device_wheels.py fetch     # make device-wheels
    python benchmarks/device_wheels.py check     # every Requires-Dist of every wheel is met there

``check`` reads each wheel's ``Requires-Dist`` (markers evaluated for CPython 3.12 on Linux
x86-64, extras left out) and fails, naming it, on a requirement neither another wheel nor the
machine's list meets; and on two versions of one package (the install there would stop).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
DEVICE_PACKAGES = ROOT / "benchmarks" / "device_packages.txt"
#: the advisor's own distribution: its runtime requirements are the roots
DISTRIBUTION = "compression-advisor"
#: the machine: markers are evaluated for it
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def device_packages(path: Path = DEVICE_PACKAGES) -> set[str]:
    """The packages the machine has (canonical names)."""
    lines = path.read_text().splitlines()
    return {canonicalize_name(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def applies(requirement: Requirement) -> bool:
    """Whether a requirement holds on the machine (its marker true there, no extra asked for)."""
    return requirement.marker is None or requirement.marker.evaluate(TARGET)


def needed(roots: list[str], have: set[str]) -> dict[str, str]:
    """``{package: installed version}`` of every requirement, transitively, that the machine lacks.

    Requirements are read from this environment's installed metadata, so the versions carried
    are the ones the tests ran with.  A package the machine has is not followed further.
    """
    wanted: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in wanted or name in have:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: run `make install` first") from None
        wanted[name] = dist.version
        todo += [Requirement(r).name for r in dist.requires or [] if applies(Requirement(r))]
    return wanted


def advisor_requirements() -> list[str]:
    """The advisor's own runtime requirements (no extras), from its installed metadata."""
    return [Requirement(r).name for r in metadata.distribution(DISTRIBUTION).requires or []
            if applies(Requirement(r))]


def fetch(wheels: Path = WHEELS) -> list[Path]:
    """Download the missing packages' wheels for the machine into ``wheels`` (replacing what was there)."""
    wanted = needed(advisor_requirements(), device_packages())
    wheels.mkdir(exist_ok=True)
    for old in wheels.glob("*.whl"):
        old.unlink()
    pins = [f"{name}=={version}" for name, version in sorted(wanted.items())]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(wheels)]
    command += [arg for p in PLATFORMS + ["any"] for arg in ("--platform", p)]
    subprocess.run(command + pins, check=True)
    found = sorted(wheels.glob("*.whl"))
    print(f"fetched {len(found)} wheels into {wheels}: " + ", ".join(p.name for p in found))
    return found


def wheel_metadata(path: Path) -> tuple[str, str, list[Requirement]]:
    """(canonical name, version, requirements) of a wheel, from its METADATA."""
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if re.match(r"[^/]+\.dist-info/METADATA$", n))
        text = zf.read(name).decode()
    fields = {k: v for k, v in (line.split(": ", 1) for line in text.splitlines() if ": " in line and
                                line.split(": ", 1)[0] in ("Name", "Version"))}
    requires = [Requirement(line.split(": ", 1)[1]) for line in text.splitlines() if line.startswith("Requires-Dist: ")]
    return canonicalize_name(fields["Name"]), fields["Version"], requires


def check(wheels: Path = WHEELS) -> list[str]:
    """Problems with the wheel set for the machine (empty: complete); each names the wheel and what it lacks."""
    paths = sorted(wheels.glob("*.whl"))
    if not paths:
        return [f"no wheels in {wheels}: run `make device-wheels`"]
    have = device_packages()
    carried: dict[str, list[str]] = {}
    requirements = []
    for path in paths:
        name, version, requires = wheel_metadata(path)
        carried.setdefault(name, []).append(version)
        requirements += [(path.name, r) for r in requires if applies(r)]
    problems = [f"{name}: {len(versions)} versions carried ({', '.join(versions)}); keep one"
                for name, versions in carried.items() if len(versions) > 1]
    for wheel, requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name in carried:
            if not requirement.specifier.contains(carried[name][0], prereleases=True):
                problems.append(f"{wheel} needs {requirement}, but {name} {carried[name][0]} is carried")
        elif name not in have:
            problems.append(f"{wheel} needs {requirement}: neither carried nor on the machine")
    missing = [r for r in advisor_requirements() if canonicalize_name(r) not in carried | dict.fromkeys(have)]
    problems += [f"the advisor needs {r}: neither carried nor on the machine" for r in missing]
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["fetch", "check"])
    args = parser.parse_args(argv)
    if args.what == "fetch":
        fetch()
    problems = check()
    for p in problems:
        print(f"FAIL  {p}")
    if not problems:
        print(f"the wheel set in {WHEELS} is complete for the machine")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
