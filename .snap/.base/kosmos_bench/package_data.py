"""Files shipped inside the kosmos_bench package (pyproject.toml's package-data): the default suites.

The YAML files live in kosmos_bench/suite_files/; the repository's top-level ``suites`` is a symbolic link to that
folder, so ``--suite suites/tp-default.yaml`` works from a checkout and an installed wheel finds the same files
here (one copy of each). Standard library only: the report imports it without torch."""
from __future__ import annotations

from pathlib import Path

SUITES_DIR = Path(__file__).resolve().parent / "suite_files"
DEFAULT_SUITE_FILES = {"tp": SUITES_DIR / "tp-default.yaml", "moe": SUITES_DIR / "moe-default.yaml"}
