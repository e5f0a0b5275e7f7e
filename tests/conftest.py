"""Shared test set-up: quiet TensorFlow logs and keep TF on the CPU; TensorFlow imported only by the tests that
use it (the ``tensorflow`` fixture), so collecting the suite or running ``pytest -m unit`` never imports it; every
test must carry a tier marker (pytest.ini)."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

#: A test belongs to at least one of these tiers (``slow`` only adds to one of them).
TIERS = ("unit", "tf", "e2e", "browser", "torch", "jax")


@pytest.fixture(scope="session")
def tensorflow():
    """The ``tensorflow`` module; the test is skipped where TensorFlow is not installed."""
    return pytest.importorskip("tensorflow")


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} test(s) without a tier marker ({', '.join(TIERS)}; see pytest.ini), e.g. "
            + ", ".join(untiered[:5])
        )
