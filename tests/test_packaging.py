"""Packaging: project metadata, the licence, and the default suites shipped as package data -- checked in a built
wheel and in a fresh virtual environment that installs it (no editable install, no repository on the path)."""
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE_FILES = ("kosmos_bench/suite_files/tp-default.yaml", "kosmos_bench/suite_files/moe-default.yaml")


def test_project_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert project["authors"] == [{"name": "KOSMOS developers"}]
    assert project["classifiers"] and project["keywords"]
    assert "torch>=2.11" in project["dependencies"]  # the oldest torch this code has been run on
    assert project["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kosmos.__version__"}
    assert "suite_files/*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["kosmos_bench"]


def test_license_is_the_apache_license_2_0():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_one_copy_of_each_suite():
    """suites/ (what users type) is a link to the packaged folder: no second copy to drift."""
    assert (ROOT / "suites").is_symlink() and (ROOT / "suites").resolve() == ROOT / "kosmos_bench" / "suite_files"
    assert sorted(p.name for p in (ROOT / "kosmos_bench" / "suite_files").iterdir() if p.suffix == ".yaml") == \
        ["moe-default.yaml", "moe-hf.yaml", "tp-default.yaml", "tp-grid.yaml"]


def _setuptools_ok() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (so no build/ or egg-info lands in the checkout)."""
    if not _setuptools_ok():
        pytest.skip("needs setuptools >= 77 in this environment (the build runs without isolation)")
    import shutil
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("kosmos", "kosmos_bench"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("whl")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=120)
    (whl,) = out.glob("kosmos-*.whl")
    return whl


def test_wheel_ships_the_suites_and_the_licence(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for f in SUITE_FILES:
        assert f in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "Author: KOSMOS developers" in meta
    assert "Requires-Dist: torch>=2.11" in meta
    assert not any(n.startswith(("tests/", "dev/", "suites/")) for n in names)


def test_installed_wheel_finds_its_default_suites(wheel, tmp_path):
    """A fresh venv with the wheel installed (--no-deps; torch and the rest come from this environment through a
    .pth line, whose own .pth files -- this checkout's editable install -- are not read): default_suite() loads the
    packaged file, and `--suite tp-default` names it where there is no suites/ folder."""
    import os
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # nothing from here
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    py = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=120)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True, env=clean).stdout.strip()
    outer = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "outer.pth").write_text("\n".join(outer) + "\n")
    code = ("import kosmos_bench, pathlib; from kosmos_bench.suites import DEFAULT_SUITE, default_suite; "
            "print(pathlib.Path(kosmos_bench.__file__).parent); print(DEFAULT_SUITE); s = default_suite(); "
            "print(s.name, s.targets['geomean_speedup'])")
    got = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env=clean, timeout=120).stdout.splitlines()
    assert got[0] == site + "/kosmos_bench" and got[1] == site + "/kosmos_bench/suite_files/tp-default.yaml"
    assert got[2] == "tp-default 1.15"  # the file's targets, not the built-in TPSuite() (which has none)
    r = subprocess.run([str(env / "bin" / "kosmos"), "bench", "moe", "--suite", "moe-default", "--dry-run"],
                       capture_output=True, text=True, cwd=tmp_path, env=clean, timeout=120)
    assert r.returncode == 0 and "deepseek-v3" in r.stdout, r.stderr


def test_old_import_paths_still_work_and_warn():
    """kosmos/_moved.py: the import paths of 0.1.0 import for one release with a DeprecationWarning; an alias IS the
    moved module (a monkeypatch through it reaches the code), a split module holds its parts' names."""
    import importlib
    import sys
    import warnings
    import kosmos.core.runtime
    import kosmos.ops.all_gather_matmul
    import kosmos.ops.moe_backward.api
    for old in ("kosmos.runtime", "kosmos.kernels.all_gather_matmul", "kosmos.kernels.moe_backward",
                "kosmos.kernels.common"):
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mod = importlib.import_module(old)
        assert any(issubclass(w.category, DeprecationWarning) and "moved to" in str(w.message) for w in seen), old
        if old == "kosmos.runtime":
            assert mod is kosmos.core.runtime
        if old == "kosmos.kernels.all_gather_matmul":
            assert mod is kosmos.ops.all_gather_matmul
        if old == "kosmos.kernels.moe_backward":
            assert mod.moe_backward is kosmos.ops.moe_backward.api.moe_backward and hasattr(mod, "BWD_ALL_STAGES")
        if old == "kosmos.kernels.common":
            assert hasattr(mod, "tma_descriptor") and hasattr(mod, "w1_matmul_kernel") and hasattr(mod, "tp_route")


def test_the_library_holds_no_work_log_and_no_file_over_1200_lines():
    """The house rules of kosmos/: no module over 1,200 lines, no dated work-log line (dates, session numbers, run
    names such as s24k) -- figures and history live in docs/perf/ and docs/design/."""
    import re
    root = Path(__file__).resolve().parent.parent / "kosmos"
    dated = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|[Ss]ession [0-9]+|\bs[0-9]{1,2}[a-k]\b")
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        assert len(lines) <= 1200, (path, len(lines))
        hits = [f"{path.name}:{i + 1}: {line.strip()}" for i, line in enumerate(lines) if dated.search(line)]
        assert not hits, hits[:5]
