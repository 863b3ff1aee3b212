"""Progress display for the long steps of the command line (writing the demo model, reading and
loading weights, measuring): a rich bar on stderr when it is a terminal.

Contract: `load_progress(label)` is a context manager yielding a callback `(done, total, step=None)`:
`total` may change between calls, `step` (when given) names the current step next to the label.
On a terminal the bar shows the label, the step, done/total and the elapsed time, and disappears
when the block ends. Elsewhere (a log file, a pipe) it shows nothing, so that logs and the one-line
errors of the command line stay as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ProgressFn = Callable[..., None]


@contextmanager
def load_progress(label: str) -> Iterator[ProgressFn]:
    if not sys.stderr.isatty():
        yield lambda done, total, step=None: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int, step: str | None = None) -> None:
            description = f"{label}: {step}" if step else label
            bar.update(task, completed=done, total=total, description=description)

        yield update
