"""Stand-ins shared by the in-process collector tests: a writer that keeps the rows it is given."""

from __future__ import annotations


class ListWriter:
    """A ``RankWriter`` stand-in: every row written, in order, with its table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict]] = []

    def write(self, table: str, row: dict) -> None:
        self.rows.append((table, dict(row)))

    def table(self, name: str) -> list[dict]:
        return [r for t, r in self.rows if t == name]

