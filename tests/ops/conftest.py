"""Shared fixtures for op tests: each op builds once per session (then from the cache)."""

import pytest

from zero.ops.builder import OpBuildError, get_builder


@pytest.fixture(scope="session")
def cpu_adam_op():
    """The compiled cpu_adam module; the test skips, with the reason, where it cannot be built."""
    try:
        return get_builder("cpu_adam").load()
    except OpBuildError as error:
        pytest.skip(f"cpu_adam cannot be built here: {error}")
