import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def devices():
    """The cache backends to run a test on: host always, CUDA as a gpu-marked param."""
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
