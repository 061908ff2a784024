"""Developer probes and tools in use (dev/README.md; not packaged; nothing in kosmos/ or kosmos_bench/ imports them).
Each script's docstring carries the command that runs it, from the repository root with PYTHONPATH=. The stage
scripts of past device sessions and the probes of closed investigations are in dev/archive/ (not maintained).
"""
