"""Kill this worker in the middle of a sharded save: the crash of the sharded-checkpoint tests, in one place.

``die_while_saving()`` replaces the CRC pass that ``checkpoint/sharded.py`` runs right after this worker has
written its shard file: the file is cut to half its size and the process SIGKILLs itself, as a machine lost
mid-write would leave it.
"""

import os
import signal

from distrib.checkpoint import sharded


def die_while_saving() -> None:
    real = sharded.sf.crc_of_file

    def die_halfway(path: str, *args: object, **kwargs: object) -> int:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
        return real(path)

    sharded.sf.crc_of_file = die_halfway  # type: ignore[assignment]
