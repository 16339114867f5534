"""Preemption notices go to a launcher and to a task's parent: each launch here has a fork server of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_fork_server(own_fork_server: None) -> None:
    """(see tests/conftest.py's ``own_fork_server``)"""
