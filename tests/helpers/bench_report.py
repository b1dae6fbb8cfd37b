"""Reading the benchmark's printed report in tests."""

from __future__ import annotations


def table_rows(report: str, first_cell: str = "method") -> dict[str, list[str]]:
    """Row name → the cells of its row, from the first markdown table in ``report`` whose header starts with
    ``first_cell`` (the report prints several tables)."""
    rows: dict[str, list[str]] = {}
    inside = False
    for line in report.splitlines():
        if line.startswith(f"| {first_cell} |") and not rows and not inside:
            inside = True
        elif inside and line.startswith("| "):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = cells
        elif inside and not line.startswith("|"):
            break  # the table ended
    return rows
