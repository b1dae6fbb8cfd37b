"""``zero-estimate``'s two tables judge every configuration against one machine: the same RAM (``--ram``, also
spelled ``--host-memory``), disk and device memory, so their fits columns agree row for row."""

from __future__ import annotations

import re

import pytest

from zero_strategy.estimate.cli import main

COMMAND = ["--params", "65B", "--world-size", "8", "--device-memory", "80GB", "--host-memory", "1TB"]


def _fits_columns(out: str) -> tuple[dict[str, str], dict[str, str]]:
    """(configuration → fits) of the first table (bytes by category) and of the second (set-up/training peaks)."""
    tables: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == "configuration":
            assert cells[-1] == "fits", f"a table without its fits column: {line}"
            current = {}
            tables.append(current)
        elif current is not None and line.strip() and not line.startswith("-"):
            current[cells[0]] = cells[-1]
        elif current is not None and not line.strip() and current:
            current = None
    assert len(tables) == 2, out
    return tables[0], tables[1]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(60)
def test_the_65b_example_tables_agree_and_nvme_asks_for_the_disk(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = _fits_columns(_run(COMMAND, capsys))
    assert len(first) == 11 and first == second
    # 8 x 121 GiB of host state per rank is over 85 % of 1 TB (931 GiB); without --disk no nvme row fits
    assert set(first.values()) == {"no"}
    out = _run(COMMAND, capsys)
    assert "Nothing fits in 80 GB (74.5 GiB) per device, RAM 931 GiB per node shared by 8 ranks" in out
    assert "The nvme configurations need --disk" in out


@pytest.mark.timeout(60)
def test_with_a_disk_both_tables_pick_the_same_nvme_rows(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run([*COMMAND, "--disk", "20TB"], capsys)
    first, second = _fits_columns(out)
    assert first == second
    assert first["zero3 opt→nvme"] == first["zero3 opt→nvme param→nvme"] == "yes"
    assert first["zero3 opt→cpu"] == first["zero3 opt→cpu param→cpu"] == "no"  # the same host state in RAM
    assert "Smallest that fits in 80 GB (74.5 GiB) per device, RAM 931 GiB and disk 18626 GiB" in out
    assert ": zero3 opt→nvme — device" in out


@pytest.mark.timeout(60)
def test_ram_and_host_memory_are_one_setting(capsys: pytest.CaptureFixture[str]) -> None:
    by_host_memory = _run(COMMAND, capsys)
    by_ram = _run([*COMMAND[:-2], "--ram", "1TB"], capsys)
    both = _run([*COMMAND, "--ram", "1000GB"], capsys)  # the same bytes, spelled differently
    assert by_host_memory == by_ram == both
    with pytest.raises(SystemExit, match=r"--ram \(745\.1 GiB\) and --host-memory \(931\.3 GiB\) .* disagree"):
        main([*COMMAND, "--ram", "800GB"])
