import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import dist  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_environ():
    """A test's changes to the environment (Megatron's models set NVTE_* flags) end with the test."""
    saved = dict(os.environ)
    yield
    dist._restore_environ(saved)


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_pools():
    yield
    dist.shutdown()
