import functools
import os
import re
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


# What makes a test module Megatron-facing: it builds or drives Megatron (directly, through the GPT kit or
# Megatron-LM's scripts, or through the plugin's Megatron, job and Bridge layers).
_MEGATRON_FACING = re.compile(r"megatron\.(core|training)|gpt_kit|megatron_lm|launch|megatron_longctx\.(megatron|job|bridge)")


def pytest_addoption(parser):
    parser.addoption("--megatron-facing", action="store_true",
                     help="run only the test modules that build or drive Megatron (the oldest-Megatron run: the "
                          "attention, kernel and planner tests do not depend on Megatron's version)")


@functools.cache
def _is_megatron_facing(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        return bool(_MEGATRON_FACING.search(f.read()))


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--megatron-facing"):
        return
    keep = [item for item in items if _is_megatron_facing(str(item.path))]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
