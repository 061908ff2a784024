"""Developer probes and device-session scripts (not packaged; nothing in kosmos/ or kosmos_bench/ imports them).
Each script's docstring carries the command that runs it, from the repository root with PYTHONPATH=.
"""
