"""Fixtures of the fault-injection suite: those of the trainer tests."""

from tests.train.conftest import cache_dir, corpus  # noqa: F401
