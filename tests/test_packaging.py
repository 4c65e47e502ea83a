"""What `pip install rlboost` puts into site-packages: one name, `rlboost`. The repository's
trainer/, workers/ and benchmarks/ folders install under it (pyproject.toml's package-dir), so a
stray `benchmarks` or `workers` package of another distribution can neither shadow ours nor be
overwritten by it."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"rlboost": "rlboost", "trainer": "rlboost.trainer", "workers": "rlboost.workers",
           "benchmarks": "rlboost.benchmarks"}


def listed_packages() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_folder_with_an_init_is_a_listed_package_and_nothing_else():
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert listed_packages() == found


@pytest.mark.slow
def test_the_wheel_installs_one_name_and_its_commands_import(tmp_path):
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:  # a copy: the build's egg-info and build/ must not land in the user's checkout
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes((ROOT / f).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("rlboost-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top,) = [n for n in names if n.endswith("top_level.txt")] or [None]
        tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert tops == {"rlboost"}
        if top:
            assert z.read(top).decode().split() == ["rlboost"]
    assert "rlboost/workers/engines/__init__.py" in names and "rlboost/trainer/command.py" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    # run from an empty folder with the installed copy first on the path: the checkout's
    # editable finder must not be what answers
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = ("import rlboost.workers.main, rlboost.trainer.command, rlboost.benchmarks.scale;"
             "print(rlboost.workers.main.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip().startswith(str(target))
    helped = subprocess.run([sys.executable, "-m", "rlboost.cli", "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr
    assert "worker" in helped.stdout and "run" in helped.stdout
