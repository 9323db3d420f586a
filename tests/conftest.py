"""Fixtures shared by the test modules."""

import logging

import pytest


@pytest.fixture
def zero_log():
    """Messages of the "zero" logger (it does not propagate to pytest's caplog)."""
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("zero")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)
