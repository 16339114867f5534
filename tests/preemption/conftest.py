"""A notice sent to a task's parent (tests/scripts/preempt_train.py's ``--notice-to launcher``: ``os.getppid()``)
must reach the launcher: such a trial's launch has a fork server of its own, whose tasks are the launcher's
children. A task of the session's shared server has another parent (the server's relay), so the other tests here,
whose notices go to a task itself or to the launcher's pid, share it as the rest of the suite does."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_fork_server_for_a_notice_to_the_parent(request: pytest.FixtureRequest) -> None:
    """(see tests/conftest.py's ``own_fork_server``)"""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("via") == "launcher":
        request.getfixturevalue("own_fork_server")
