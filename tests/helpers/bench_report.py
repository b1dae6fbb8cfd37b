"""Reading the benchmark's printed report in tests."""

from __future__ import annotations


def table_rows(report: str) -> dict[str, list[str]]:
    """Method name → the cells of its row, from the markdown table in ``report``."""
    rows = {}
    for line in report.splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells
    return rows
