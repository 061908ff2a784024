"""The shared bench loop (kosmos_bench.sweep.run_sweep): env line first, rows appended as measured, a case that
raises recorded as failed for its rows not yet written, the sweep going on."""
import json

from kosmos_bench.sweep import run_sweep


def test_failed_case_keeps_measured_rows_and_goes_on(tmp_path):
    out = tmp_path / "r.jsonl"
    recovered = []

    def run_one(case, write):
        write({"case": case, "impl": "a", "status": "ok"})
        if case == 2:
            raise RuntimeError("out of memory\nsecond line")
        write({"case": case, "impl": "b", "status": "ok"})

    def failed_rows(case, why):
        return [{"case": case, "impl": i, "status": "failed", "reason": why} for i in ("a", "b")]

    run_sweep(str(out), {"type": "env", "run_id": "x"}, 0, [1, 2, 3], describe=str, run_one=run_one,
              failed_rows=failed_rows, recover=lambda: recovered.append(1), key=lambda r: (r["case"], r["impl"]))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["type"] == "env"
    got = [(r["case"], r["impl"], r["status"]) for r in rows[1:]]
    assert got == [(1, "a", "ok"), (1, "b", "ok"), (2, "a", "ok"), (2, "b", "failed"), (3, "a", "ok"), (3, "b", "ok")]
    assert rows[4]["reason"] == "RuntimeError: out of memory" and all(r["run_id"] == "x" for r in rows[1:])
    assert recovered == [1]


def test_other_ranks_write_nothing(tmp_path):
    out = tmp_path / "r.jsonl"
    run_sweep(str(out), {"type": "env", "run_id": "x"}, 1, [1], describe=str,
              run_one=lambda c, write: write({"case": c}), failed_rows=lambda c, w: [], recover=lambda: None,
              key=lambda r: r["case"])
    assert not out.exists()


def test_source_sha_names_the_code(tmp_path):
    """The env record's source_sha: the same for the same files, different after any edit of a .py file."""
    from kosmos_bench.environment import source_sha
    for pkg in ("kosmos", "kosmos_bench"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "a.py").write_text("x = 1\n")
    (tmp_path / "kosmos" / "notes.txt").write_text("ignored")
    first = source_sha(str(tmp_path))
    assert first == source_sha(str(tmp_path)) and len(first) == 40
    (tmp_path / "kosmos" / "notes.txt").write_text("still ignored")
    assert source_sha(str(tmp_path)) == first
    (tmp_path / "kosmos_bench" / "a.py").write_text("x = 2\n")
    assert source_sha(str(tmp_path)) != first


def test_env_record_trusts_kosmos_git_commit(monkeypatch):
    """A copied tree (the device machine) may carry a stale .git: with KOSMOS_GIT_COMMIT set, the record names
    that commit and does not compare the tree against the stale .git (git_dirty None); source_sha is always
    there."""
    from kosmos_bench import environment
    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("KOSMOS_GIT_COMMIT", sha)
    env = environment.environment(argv=["kosmos", "bench", "tp"], bench="tp")
    assert env["git_commit"] == sha and env["git_dirty"] is None
    assert env["source_sha"] == environment.source_sha() and len(env["source_sha"]) == 40
    assert env["type"] == "env" and env["bench"] == "tp" and env["argv"] == ["kosmos", "bench", "tp"]
    assert "knobs" not in env  # configs are recorded per row now, no environment knobs


def test_source_sha_command_prints_the_tree_sha():
    """`python -m kosmos_bench.environment --source-sha` prints the sha of the tree it runs from."""
    import subprocess
    import sys
    from pathlib import Path

    from kosmos_bench.environment import SOURCE_ROOT, source_sha
    out = subprocess.run([sys.executable, "-m", "kosmos_bench.environment", "--source-sha"], capture_output=True,
                         text=True, cwd=Path(SOURCE_ROOT), timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == source_sha()
