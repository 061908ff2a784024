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
    from kosmos_bench.tp import source_sha
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


def test_knobs_sets_and_restores_the_environment(monkeypatch):
    import os
    from kosmos_bench.launcher import knobs
    monkeypatch.setenv("KOSMOS_AG_COPY_BLOCK", "4096")
    monkeypatch.delenv("KOSMOS_RS_PUSH", raising=False)
    with knobs("KOSMOS_AG_COPY_BLOCK=8192,KOSMOS_RS_PUSH=1") as env:
        assert env == {"KOSMOS_AG_COPY_BLOCK": "8192", "KOSMOS_RS_PUSH": "1"}
        assert os.environ["KOSMOS_AG_COPY_BLOCK"] == "8192" and os.environ["KOSMOS_RS_PUSH"] == "1"
    assert os.environ["KOSMOS_AG_COPY_BLOCK"] == "4096" and "KOSMOS_RS_PUSH" not in os.environ
    with knobs(""):
        assert os.environ["KOSMOS_AG_COPY_BLOCK"] == "4096"


def test_env_record_trusts_kosmos_git_commit(monkeypatch):
    """A copied tree (the device machine) may carry a stale .git: with KOSMOS_GIT_COMMIT set, the record names
    that commit and does not compare the tree against the stale .git (git_dirty None); source_sha is always
    there."""
    from kosmos_bench import tp
    sha = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("KOSMOS_GIT_COMMIT", sha)
    env = tp.environment()
    assert env["git_commit"] == sha and env["git_dirty"] is None
    assert env["source_sha"] == tp.source_sha() and len(env["source_sha"]) == 40
    assert "KOSMOS_GIT_COMMIT" not in env["knobs"]
