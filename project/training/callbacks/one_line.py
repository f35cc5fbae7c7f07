"""Rich progress columns that keep a bar and its figures on one line (project.training.callbacks.progress):
imported only by the rich bar, since rich is optional."""

from __future__ import annotations

from rich.console import RenderableType
from rich.progress import ProgressColumn, Task
from rich.table import Column
from rich.text import Text


class Whole(ProgressColumn):
    """`column` never wrapped: the bar, the counts, the times."""

    def __init__(self, column: ProgressColumn):
        super().__init__(table_column=Column(no_wrap=True))
        self.column = column

    def render(self, task: Task) -> RenderableType:
        return self.column(task)  # through its own cache, which Lightning's columns read


class CutShort(Whole):
    """`column` the one that gives way where the line is too short: its text ends in an ellipsis there."""

    def __init__(self, column: ProgressColumn):
        ProgressColumn.__init__(self)  # a column rich may narrow, as Whole's are not
        self.column = column

    def render(self, task: Task) -> RenderableType:
        drawn = self.column(task)
        if isinstance(drawn, Text):
            drawn = drawn.copy()
            drawn.no_wrap, drawn.overflow = True, "ellipsis"
        return drawn
