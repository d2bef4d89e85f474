"""The distributions: the wheel installs meshgroups (with meshgroups.compat) and nothing named
compat, typed and licensed; the sdist carries its tests and they run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

pytestmark = pytest.mark.processes  # every test here starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    for hook in ("build_wheel", "build_sdist"):  # PEP 517 hooks, one process each
        code = f"import sys; from setuptools import build_meta as b; b.{hook}(sys.argv[1])"
        subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, capture_output=True)
    wheel = next(out.glob("*.whl"))
    sdist = next(out.glob("*.tar.gz"))
    return wheel, sdist, out


def test_wheel_contents(dists):
    wheel, _, _ = dists
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("compat/")], "a top-level compat package is installed"
    for needed in (
        "meshgroups/py.typed",
        "meshgroups/compat/py.typed",
        "meshgroups/compat/parallel_state.py",
        "meshgroups/compat/group_initializer.py",
    ):
        assert needed in names, needed
    # every module of the source tree ships (a subpackage missing from pyproject's list would not)
    sources = {
        f"meshgroups/{p.relative_to(ROOT / 'meshgroups').as_posix()}"
        for p in (ROOT / "meshgroups").rglob("*.py")
    }
    sources |= {
        f"meshgroups/compat/{p.relative_to(ROOT / 'compat').as_posix()}"
        for p in (ROOT / "compat").rglob("*.py")
    }
    assert sources - set(names) == set(), sorted(sources - set(names))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    )
    assert "License-Expression: Apache-2.0" in metadata


def test_wheel_installs_and_imports_outside_the_checkout(dists, tmp_path):
    wheel, _, _ = dists
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
    )
    (tmp_path / "compat.py").write_text(
        "raise SystemExit('a user module named compat must not be imported')\n"
    )
    code = (
        "import meshgroups, meshgroups.compat.group_initializer as gi, meshgroups.compat.parallel_state as ps; "
        f"assert meshgroups.__file__.startswith({str(site)!r}), meshgroups.__file__; "
        "print(gi.TPGroupInitializer(5, 8, 4).layout, len(ps.__all__))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Layout(rest=2, tp=4)" in out.stdout


def test_sdist_tests_run(dists, tmp_path):
    _, sdist, _ = dists
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    top = next(tmp_path.iterdir())
    for needed in (
        "LICENSE",
        "tests/support/dist.py",
        "tests/support/megatron_oracle.py",
        "tests/layout/test_layout_order.py",
        "compat/py.typed",
    ):
        assert (top / needed).exists(), needed
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/layout/test_layout_order.py"],
        cwd=top,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
