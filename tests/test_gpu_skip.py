"""The GPU skip hook must skip exactly when no CUDA device exists (never always-on)."""

import pytest
from conftest import cuda_available


def test_skip_condition_matches_torch():
    import torch

    assert cuda_available() == (torch.cuda.is_available() and torch.cuda.device_count() > 0)


@pytest.mark.gpu
def test_gpu_tests_run_where_cuda_exists():
    import torch

    assert torch.cuda.is_available()  # reached only when the hook did not skip
