"""Shared pytest settings."""

import pytest
import torch
from hypothesis import settings

# Reproducible runs in CI; locally too, so a failure seen once is seen again.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, with the reason, where no CUDA device is visible.

    ``scripts/gpu-check.sh`` runs ``-m "gpu and not gpu_job"`` on a GPU machine and fails on any skip
    there; it runs the MPI jobs of the ``gpu_job`` tests itself, each under its own timeout.
    """
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine (scripts/gpu-check.sh runs these on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
