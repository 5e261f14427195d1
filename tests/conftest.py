import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import dist  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    yield
    dist.shutdown()
