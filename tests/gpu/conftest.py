"""GPU tests: skipped as a whole where no CUDA driver/GPU is usable (CI)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cuda_ok() -> bool:
    try:
        from kvoffd.transfer import cuda_driver as cudart

        return cudart.available()
    except Exception:  # noqa: BLE001 - any failure to probe the driver means "no usable GPU": skip
        return False


CUDA = _cuda_ok()
#: tests that must also pass without a GPU (they check that CI is unaffected)
NO_CUDA_NEEDED = {"test_import_without_cuda_is_cheap", "test_pinner_gives_up_cleanly_without_cuda",
                  "test_batch_cuts_bound_runs_and_bytes"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not CUDA and item.originalname not in NO_CUDA_NEEDED:
                item.add_marker(skip)
