"""The bars a report judges results against: the ``targets`` of a suite (suites/*.yaml says what each key means;
suite_targets.py checks them, for kosmos_bench/suites.py too). Nothing in the report holds a bar itself.

The env line of every results file records the suite as run (``env["suite"]``), so the rows of a run are judged
against that suite's targets. A recorded suite without ``targets`` (files written before suites had them), or one
that leaves a key out, falls back key by key to the default suite file of the rows' bench
(suites/tp-default.yaml, suites/moe-default.yaml), whose ``targets`` are read from the YAML alone
(``suite_file_targets``: no suite is built, so the report never imports kosmos_bench.suites and torch). Tables
built without a results file (``build_table`` on records that carry no ``suite_targets``) use the default suite's
targets too.
"""

from __future__ import annotations

from functools import lru_cache

import pandas as pd

from .schema import ReportError
from .suite_targets import DEFAULT_SUITE_FILES, TargetsError, check_targets, suite_file_targets


def run_targets(env: dict, bench: str, where) -> dict:
    """The targets for the ``bench`` rows of the run whose env line is ``env``; ``where`` (the file) names it in
    errors. A malformed recorded ``targets`` mapping raises ReportError."""
    suite = env.get("suite")
    recorded = suite.get("targets") if isinstance(suite, dict) else None
    if recorded is None:
        return default_targets(bench)
    try:
        check_targets(bench, recorded)
    except TargetsError as error:
        raise ReportError(f"{where}: the suite of run {env.get('run_id')} has malformed targets: {error}") from None
    return {**default_targets(bench), **recorded}


def default_targets(bench: str) -> dict:
    """The targets of the default suite file of ``bench``; {} for a bench without one."""
    return dict(_default_targets(bench))


@lru_cache(maxsize=None)
def _default_targets(bench: str) -> tuple:
    if bench not in DEFAULT_SUITE_FILES:
        return ()
    try:
        return tuple(suite_file_targets(DEFAULT_SUITE_FILES[bench], bench).items())
    except TargetsError as error:
        raise ReportError(f"default {bench} suite: {error}") from None


def table_targets(rows: list[dict]) -> dict[tuple, dict]:
    """{(source, bench): targets} from rows that carry ``suite_targets``; the last run of a source wins."""
    return {(row["source"], row["bench"]): row["suite_targets"] for row in rows if row.get("suite_targets") is not None}


def target_of(df: pd.DataFrame, source: str, bench: str, key: str) -> float | None:
    """Target ``key`` for the rows of (source, bench) of a table from ``build_table``; None when unset."""
    targets = df.attrs.get("targets", {}).get((source, bench))
    return (default_targets(bench) if targets is None else targets).get(key)
