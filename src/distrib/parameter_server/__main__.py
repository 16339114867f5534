"""``python -m distrib.parameter_server``: run this process's ``ps`` or ``worker`` task and wait.

Reads the task from ``TF_CONFIG`` (``{"cluster": {...}, "task": {"type": "ps", "index": 0}}``)
and the cluster token from ``DISTRIB_CLUSTER_TOKEN``; TLS from ``DISTRIB_TLS_CERT``,
``DISTRIB_TLS_KEY`` and ``DISTRIB_TLS_CA`` when set. This is what ``distrib launch``
starts for every ps and worker task of a parameter-server cluster. Stops on SIGTERM
or SIGINT. Exit status: 0 after a stop, 2 for a configuration error.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from distrib.cluster import TFConfigClusterResolver, TFConfigError
    from distrib.parameter_server.server.server import Server
    from distrib.startup import freeze_imports

    freeze_imports()  # torch is imported: its objects are never garbage (about 0.6 CPU-s less at exit)

    try:
        resolver = TFConfigClusterResolver()
    except TFConfigError as e:
        print(f"distrib.parameter_server: {e}", file=sys.stderr)
        return 2
    task = f"/job:{resolver.task_type}/task:{resolver.task_id}"
    logging.basicConfig(
        level=os.environ.get("DISTRIB_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {task} %(levelname)s %(name)s: %(message)s",
    )
    if not TFConfigClusterResolver.detect():
        print(
            "distrib.parameter_server: TF_CONFIG is not set; it must name the cluster and this task, e.g. "
            '{"cluster": {"chief": [...], "worker": [...], "ps": [...]}, "task": {"type": "ps", "index": 0}}',
            file=sys.stderr,
        )
        return 2
    if resolver.task_type not in ("ps", "worker"):
        print(
            f"distrib.parameter_server: TF_CONFIG task.type must be 'ps' or 'worker' (got "
            f"{resolver.task_type!r}); the chief runs the training script itself",
            file=sys.stderr,
        )
        return 2
    try:
        server = Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id or 0)
    except (ValueError, OSError) as e:
        print(f"distrib.parameter_server: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop(grace=0))
    while not server.join(timeout=1.0):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
