"""The search's account: what each level tried, what came of it and why (``Plan.account``, the CLI's
``--verbose`` table), and, with ``progress``, a status line on stderr naming where the search is (the
levels entered, outermost first: "pp=2 (2 of 3) > 1f1b x1 m=4 > scenario 5 of 23 > ILP, 12,345 variables").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from autopar.result.record import AccountRow


class Account:
    """Rows of the search's account and the levels it is inside; shown live on stderr with ``progress``."""

    def __init__(self, progress: bool = False) -> None:
        self.rows: list[AccountRow] = []
        self.path: list[str] = []
        self._status: Any = None
        self._progress = progress

    def record(self, level: str, item: str, outcome: str, seconds: float | None = None, detail: str = "") -> None:
        """One thing a level tried: its ``outcome`` ('chosen', 'planned', 'pruned', ...) and why (``detail``)."""
        self.rows.append(AccountRow(level=level, item=item, outcome=outcome, seconds=seconds, detail=detail))

    @contextlib.contextmanager
    def inside(self, label: str) -> Iterator[None]:
        """The search is inside ``label`` (a level's current item) while the block runs."""
        self.path.append(label)
        self.show()
        try:
            yield
        finally:
            self.path.pop()
            self.show()

    def show(self, detail: str = "") -> None:
        """Update the status line (with ``progress`` only)."""
        if not self._progress:
            return
        text = " > ".join([*self.path, detail] if detail else self.path) or "planning"
        if self._status is None:
            self._status = Console(stderr=True).status(f"autopar: {text}")
            self._status.start()
        else:
            self._status.update(f"autopar: {text}")

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


@contextlib.contextmanager
def timed(name: str, timings: dict[str, float], account: Account) -> Iterator[None]:
    """A stage of planning (capture, strategies, solve): its wall seconds into ``timings[name]``, its name
    on the status line while it runs."""
    start = time.perf_counter()
    with account.inside(name):
        yield
    timings[name] = time.perf_counter() - start
