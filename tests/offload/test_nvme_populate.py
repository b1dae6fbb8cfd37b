"""NvmeStore.populate maps exactly the pages under the views it is given, in one call (see [Note: populating a
chunk before its step] in core/flat/placement.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_strategy.core.flat.placement import NvmeStore
from zero_strategy.process_memory import status_bytes

MIB = 2**20


@pytest.mark.timeout(30)
def test_populate_maps_the_views_pages_only(tmp_path: Path) -> None:
    store = NvmeStore(tmp_path, rank=0)
    try:
        tensor = store.tensor("t", 16 * MIB // 4, torch.float32)
        tensor.fill_(1.5)  # the file's pages now exist in the page cache
        store.release_pages()
        before = status_bytes("VmRSS")
        store.populate([tensor[1000 : 1000 + 4 * MIB // 4], torch.ones(10)])  # the second is in no file: skipped
        if not store._can_populate:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        grown = status_bytes("VmRSS") - before
        assert 4 * MIB - 8192 <= grown <= 4 * MIB + 2 * MIB, grown / MIB  # the view's 4 MiB, not the file's 16
        assert float(tensor[1000]) == 1.5 and float(tensor[-1]) == 1.5  # populating keeps the file's values
    finally:
        store.close()
