"""A benchmark's runs, one after another, with their progress shown.

``for item in steps(items, name)`` prints ``[i/n] name ...`` before each run, as the benches
always did; when stdout is a terminal a rich bar below those lines also shows the runs done,
the time so far and the run in progress. In a log (stdout not a terminal) the output is the
plain lines alone, so the tables and the closing ``key=value`` line read as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from site_client.transfer.progress import terminal

T = TypeVar("T")


def step_line(i: int, n: int, name: str) -> str:
    return f"[{i}/{n}] {name} ..."


def steps(
    items: Iterable[T],
    name: Callable[[T], str] = str,
    *,
    tty: bool | None = None,
    console=None,
) -> Iterator[T]:
    """Yield ``items``, announcing each by ``name(item)``.

    Parameters
    ----------
    tty
        Draw the bar; default: whether stdout is a terminal.
    console
        The rich console for the bar and the lines (default: stdout's).
    """
    items = list(items)
    n = len(items)
    if tty is None:
        tty = sys.stdout.isatty()
    # One live display per terminal: a transfer's bar in this process keeps it plain.
    if not tty or not terminal.acquire(blocking=False):
        for i, item in enumerate(items, 1):
            print(step_line(i, n, name(item)), flush=True)
            yield item
        return
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        columns = (MofNCompleteColumn(), BarColumn(), TimeElapsedColumn())
        bar = Progress(*columns, TextColumn("{task.description}"), console=console or Console())
        with bar:
            task = bar.add_task("", total=n)
            for i, item in enumerate(items, 1):
                label = name(item)
                bar.console.print(step_line(i, n, label), markup=False, highlight=False)
                bar.update(task, description=label)
                yield item
                bar.advance(task)
    finally:
        terminal.release()
