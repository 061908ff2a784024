"""KOSMOS benchmark suite: CLI, launcher, timing, baselines, suites, results and reports."""
