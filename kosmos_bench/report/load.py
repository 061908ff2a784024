"""Reading the report's inputs: result files (JSON lines: env, result and host lines, see SCHEMA.md) and
trace files (one JSON object per traced call). Malformed input raises ``ReportError`` naming the file and,
for JSON lines, the line; unknown keys and line types are ignored. One exception: the last non-blank line of a
results file that is not valid JSON is taken for a line cut short (a run killed while writing it) and skipped with
a one-line warning naming the file and line, so that the rows before it are still reported; an invalid line
anywhere before it is an error. A folder, or a file of the other kind (a trace given as results, results given as
a trace), is told apart and the error says what to pass instead."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from .schema import ENV_FIELDS, HOST_REQUIRED_KEYS, REQUIRED_RESULT_KEYS, ReportError
from .targets import run_targets

TRAIN_REQUIRED_KEYS = ("model", "impl", "status", "world", "dtype")  # bench train rows (report/train.py)


Warn = Callable[[str], None]


def _warn_on_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class Records(NamedTuple):
    """What result files hold: env lines, result lines and host lines (``bench tp --host-calls``; SCHEMA.md)."""
    envs: list[dict]
    results: list[dict]
    hosts: list[dict]


def load_results(paths: list[str | Path], warn: Warn | None = None) -> tuple[list[dict], list[dict]]:
    """Read result files; return (env records, result records) (``load_records``, without the host lines)."""
    records = load_records(paths, warn)
    return records.envs, records.results


def load_records(paths: list[str | Path], warn: Warn | None = None) -> Records:
    """Read result files; return their env, result and host records.

    Every record gets ``source`` (the file stem); result records also get the
    ENV_FIELDS of the env line with the same run_id in the same file, and ``suite_targets``: the
    targets of the suite that env line records, over the default suite's (targets.py).
    A file whose last non-blank line is not valid JSON (cut short) is read without that line: ``warn`` gets one
    line naming the file and line (default: "warning: ..." on stderr). An invalid line before the last raises
    ReportError naming the file and line. Host records get what result records get; a result or host line without
    its required keys raises ReportError naming the file and line.
    """
    if not paths:
        raise ReportError("no result files given")
    warn = warn or _warn_on_stderr
    records = Records([], [], [])
    for path in map(Path, paths):
        for kept, read in zip(records, _read_result_file(path, warn)):
            kept.extend(read)
    return records


def _read_result_file(path: Path, warn: Warn) -> tuple[list[dict], list[dict], list[dict]]:
    if path.is_dir():
        found = len(list(path.glob("*.jsonl")))
        there = f" ({found} .jsonl file{'s' if found != 1 else ''} there)" if found else " (no .jsonl file there)"
        raise ReportError(f"{path} is a folder, not a result file: pass its result files, e.g. "
                          f"kosmos report {path / '*.jsonl'}{there}")
    if not path.is_file():
        raise ReportError(f"{path}: no such result file")
    source = path.stem
    envs: list[dict] = []
    raw_results: list[dict] = []
    raw_hosts: list[dict] = []
    try:
        records = list(_json_lines(path, warn))
    except ReportError:
        if _is_trace(path):
            raise ReportError(_TRACE_GIVEN.format(path=path)) from None
        raise
    for line_number, record in records:
        if record.get("type") == "env":
            envs.append({**record, "source": source})
        elif record.get("type") == "result":
            _check_required_keys(record, path, line_number)
            raw_results.append(record)
        elif record.get("type") == "host":
            missing = [key for key in HOST_REQUIRED_KEYS if record.get(key) is None]
            if missing:
                raise ReportError(f"{path}:{line_number}: host line lacks {', '.join(missing)}")
            raw_hosts.append(record)
    if not raw_results:
        if _is_trace(path):
            raise ReportError(_TRACE_GIVEN.format(path=path))
        raise ReportError(f"{path}: no result lines")
    env_by_run = {env.get("run_id"): env for env in envs}
    results, hosts = ([_with_env(record, env_by_run.get(record.get("run_id"), {}), source, path) for record in raw]
                      for raw in (raw_results, raw_hosts))
    return envs, results, hosts


_TRACE_GIVEN = ("{path} is a trace file (bench --trace), not a result file: draw its timeline with "
                "`kosmos report --timeline {path}`")


def _is_trace(path: Path) -> bool:
    """Whether ``path`` holds one JSON object of a trace (``"type": "trace"`` or a ``ranks`` list)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and (data.get("type") == "trace" or isinstance(data.get("ranks"), list))


def _is_results(path: Path) -> bool:
    """Whether the first non-blank line of ``path`` is a result file's (an env, result or host line)."""
    try:
        with path.open(encoding="utf-8") as file:
            first = next((line for line in file if line.strip()), "")
        record = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and record.get("type") in ("env", "result", "host")


def _json_lines(path: Path, warn: Warn):
    """Yield (line number, object) for the non-blank lines of a JSON-lines file; the last of them, when it is not
    valid JSON, is skipped with a warning (a line cut short), any other invalid line raises ReportError."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ReportError(f"{path}: not UTF-8 text ({error})") from error
    except OSError as error:
        raise ReportError(f"{path}: cannot read ({error.strerror or error})") from None
    last = max((number for number, line in enumerate(lines, start=1) if line.strip()), default=0)
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if line_number == last:
                warn(f"{path}:{line_number}: the last line is not valid JSON ({error.msg}), as when a run stops "
                     "while writing it: skipped, the lines before it are reported")
                return
            raise ReportError(f"{path}:{line_number}: invalid JSON: {error.msg}") from error
        if not isinstance(record, dict):
            raise ReportError(f"{path}:{line_number}: expected a JSON object")
        yield line_number, record


def _check_required_keys(record: dict, path: Path, line_number: int) -> None:
    required = TRAIN_REQUIRED_KEYS if record.get("bench") == "train" else REQUIRED_RESULT_KEYS  # no op/m/n/k
    missing = [key for key in required if record.get(key) is None]
    if missing:
        raise ReportError(f"{path}:{line_number}: result line lacks {', '.join(missing)}")
    if not isinstance(record.get("config"), (dict, type(None))):
        raise ReportError(f"{path}:{line_number}: a result's config must be an object or null")


def _with_env(record: dict, env: dict, source: str, path: Path) -> dict:
    env_fields = {field: env.get(field) for field in ENV_FIELDS}
    # developer knobs in effect (KOSMOS_* overrides) as one "K=V K=V" cell; "" when none or not recorded
    env_fields["knobs"] = " ".join(f"{k}={v}" for k, v in sorted((env.get("knobs") or {}).items()))
    merged = {**env_fields, **record, "source": source}
    merged["bench"] = record.get("bench") or env.get("bench") or "tp"
    merged["suite_targets"] = run_targets(env, merged["bench"], path)
    # the suite's own baseline for the layer's speedups (e.g. hf-grouped-mm in moe-hf), else the bench's
    merged["suite_baseline"] = (env.get("suite") or {}).get("baseline")
    return merged


# --------------------------------------------------------------------------- traces


class Trace(NamedTuple):
    title: str
    kind_names: dict[int, str]
    ranks: list[tuple[int, np.ndarray]]  # (rank, events of shape [E, 5])


def load_trace(path: Path) -> Trace:
    """A trace file: its title (op, model, impl, shape), kind names and each rank's events."""
    if path.is_dir():
        raise ReportError(f"{path} is a folder, not a trace file: pass one trace JSON file (bench --trace)")
    if not path.is_file():
        raise ReportError(f"{path}: no such trace file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        if _is_results(path):
            raise ReportError(f"{path} is a result file, not a trace: report it without --timeline "
                              f"(kosmos report {path})") from None
        raise ReportError(f"{path}: invalid trace JSON ({error})") from error
    except OSError as error:
        raise ReportError(f"{path}: cannot read ({error.strerror or error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list) or not data["ranks"]:
        raise ReportError(f"{path}: a trace needs a non-empty 'ranks' list")
    title = " ".join(
        f"{key}={data[key]}" if key in ("m", "n", "k", "world") else str(data[key])
        for key in ("op", "model", "impl", "m", "n", "k", "world") if key in data
    )
    return Trace(title, _trace_kind_names(data.get("kinds", {}), path),
                 [_trace_rank(rank, index, path) for index, rank in enumerate(data["ranks"])])


def _trace_kind_names(kinds, path: Path) -> dict[int, str]:
    if not isinstance(kinds, dict):
        raise ReportError(f"{path}: 'kinds' must map kind ids to names")
    try:
        return {int(kind): str(name) for kind, name in kinds.items()}
    except ValueError as error:
        raise ReportError(f"{path}: kind ids must be integers ({error})") from error


def _trace_rank(rank: dict, index: int, path: Path) -> tuple[int, np.ndarray]:
    if not isinstance(rank, dict) or not isinstance(rank.get("events"), list):
        raise ReportError(f"{path}: ranks[{index}] needs an 'events' list")
    try:
        events = np.asarray(rank["events"], dtype=np.float64).reshape(-1, 5) if rank["events"] else np.empty((0, 5))
    except (TypeError, ValueError) as error:
        raise ReportError(
            f"{path}: ranks[{index}] events must be [program, kind, task_id, t_start_ns, t_end_ns]"
        ) from error
    if len(events) != len(rank["events"]) or not np.isfinite(events).all():
        raise ReportError(f"{path}: ranks[{index}] events must be lists of 5 finite numbers")
    if (events[:, 4] < events[:, 3]).any():
        raise ReportError(f"{path}: ranks[{index}] has events that end before they start")
    rank_id = rank.get("rank", index)
    if not isinstance(rank_id, int):
        raise ReportError(f"{path}: ranks[{index}].rank must be an integer")
    return rank_id, events
