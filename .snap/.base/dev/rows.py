"""The developer probes' result rows: kept in a list and, with a path, written as JSON lines as each is ready
(a probe cut short by a time limit keeps every row it finished)."""
from __future__ import annotations

import json


class Rows(list):
    """A list of row dicts; ``emit(row)`` appends it and writes it to ``path`` (if any) at once."""

    def __init__(self, path: str | None = None):
        super().__init__()
        self._out = open(path, "w") if path else None

    def emit(self, row: dict) -> None:
        self.append(row)
        if self._out:
            self._out.write(json.dumps(row) + "\n")
            self._out.flush()

    def close(self) -> None:
        if self._out:
            self._out.close()
            self._out = None
