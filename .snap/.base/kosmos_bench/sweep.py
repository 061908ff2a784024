"""The rank loop every bench shares: results file, progress bar, one case at a time, failures recorded.

Rank 0 writes the environment line first, then every row as soon as it is measured (partial results survive
a crash). A case that raises is agreed on by all ranks (no rank is left waiting in a collective), the
workspace is reset (``recover``), and the case's rows not yet written are recorded as failed with the
reason; the sweep goes on.
"""
from __future__ import annotations

import json

import torch

from .harness import agreed_call


def run_sweep(out: str, env: dict, rank: int, cases: list, *, describe, run_one, failed_rows, recover, key):
    """``run_one(case, write)`` measures one case and writes its rows; ``failed_rows(case, reason)`` gives the
    rows of a case that failed as a whole; ``key(row)`` identifies a row (rows already written stay)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    f = open(out, "a") if rank == 0 else None
    if f:
        f.write(json.dumps(env) + "\n")
        f.flush()
    written = set()

    def write(row):
        written.add(key(row))
        if f:
            row["run_id"] = env["run_id"]
            f.write(json.dumps(row) + "\n")
            f.flush()

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), disable=rank != 0)
    try:
        with progress:
            task = progress.add_task("starting", total=len(cases))
            for case in cases:
                progress.update(task, description=describe(case))
                # a whole case that fails (e.g. out of memory) is recorded, the sweep goes on
                ok, why, _ = agreed_call(lambda: run_one(case, write))
                if not ok:
                    recover()
                    for row in failed_rows(case, why):
                        if key(row) not in written:
                            write(row)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                progress.advance(task)
    finally:
        if f:
            f.close()
