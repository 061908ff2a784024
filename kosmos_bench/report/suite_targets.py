"""A suite's ``targets`` (the bars a report judges its results against): the known keys per bench, their check,
and the targets of a suite file read without building the suite. Imports only the standard library, yaml and
kosmos_bench.package_data (where the packaged default suites are), so the report reads the default suites' bars
without importing kosmos_bench.suites (which imports torch through the bench modules); kosmos_bench.suites checks
its ``targets`` with the same ``check_targets``."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

# the packaged default suites (the checkout's suites/ links to them): an installed wheel has no suites/ beside it
from ..package_data import DEFAULT_SUITE_FILES

# The bars a report judges a suite's results against (`targets:` in the suite file; suites/*.yaml say what each
# means). The report reads them from the suite recorded in a results file (targets.py).
# tp's vs_cublas_geomean / vs_cublas_floor: kosmos against cuBLAS alone at world 1 (t_gemm_ms / time_ms, the
# report's section "kosmos against cuBLAS alone at world 1"): the geomean per op to reach, and the floor no shape
# may fall under (suites/tp-grid.yaml); host_enqueue_us: kosmos's host enqueue time per eager call at world 1, µs,
# not to exceed (the host rows of `bench tp --host-calls`, the report's "Host enqueue time per eager call")
TARGET_KEYS = {
    "tp": ("slower_tolerance", "geomean_speedup", "geomean_overlap_efficiency", "vs_cublas_geomean",
           "vs_cublas_floor", "host_enqueue_us"),
    "moe": ("slower_tolerance", "geomean_speedup", "geomean_overlap_efficiency", "expert_gemm_share"),
}


class TargetsError(ValueError):
    """Malformed targets, or a suite file whose targets cannot be read (one line)."""


def check_targets(bench: str, targets) -> None:
    """A suite's ``targets``: a mapping of the known target names of ``bench`` to finite numbers >= 0."""
    if not isinstance(targets, dict):
        raise TargetsError(f"'targets' must be a mapping of target names to numbers, got {type(targets).__name__}")
    allowed = TARGET_KEYS.get(bench, ())
    for key, value in targets.items():
        if key not in allowed:
            raise TargetsError(f"unknown target {key!r} in 'targets'; allowed for a {bench} suite: "
                               f"{', '.join(allowed)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise TargetsError(f"'targets.{key}' must be a number >= 0, got {value!r}")


def suite_file_targets(path: Path, bench: str) -> dict:
    """The checked ``targets`` of the ``bench`` suite file ``path`` ({} when the file has none or does not exist,
    as a suite built from no file has none). Only the file's ``bench`` and ``targets`` keys are read:
    kosmos_bench.suites.load_suite checks the rest."""
    if not path.is_file():
        return {}
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise TargetsError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(doc, dict):
        raise TargetsError(f"{path}: a suite must be a YAML mapping of keys (name, models, seq, ...)")
    if doc.get("bench", "tp") != bench:
        raise TargetsError(f"{path} is a {doc.get('bench')!r} suite, not a {bench!r} one")
    targets = doc.get("targets", {})
    try:
        check_targets(bench, targets)
    except TargetsError as error:
        raise TargetsError(f"{path}: {error}") from None
    return dict(targets)
