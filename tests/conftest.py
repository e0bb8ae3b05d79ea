import os

import pytest
import torch

# The parity grids run a reduced default; KVCACHE_EXT_FULL_GRID=1 runs every combination.
FULL_GRID = os.environ.get("KVCACHE_EXT_FULL_GRID") == "1"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
