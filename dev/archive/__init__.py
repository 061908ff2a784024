"""Archived developer probes of closed investigations (dev/archive/README.md): kept for the record, not maintained
or tested. Run one from the repository root as ``PYTHONPATH=. python -m dev.archive.NAME``."""
