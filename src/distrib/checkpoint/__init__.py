"""Save and restore training state, mirroring ``tf.train.Checkpoint`` and its helpers.

A checkpoint ``<prefix>`` is one ``torch.save`` file, ``<prefix>.pt``, holding plain, whole
CPU tensors under their names (``format.py`` gives the layout), with a CRC-32 per tensor and
one over everything else, verified on every load. Files are only read with
``torch.load(..., weights_only=True)``: restoring never runs code from a file. Files of
format version 1 (before checksums) still load.

Writes are atomic (temporary file, fsync, rename) and a directory's ``checkpoint`` index
(JSON, ``index.py``) is replaced only after the data file is in place, so a crash mid-save
leaves :func:`latest_checkpoint` on the previous save; the next save removes what the crash
left. A failed write (a full disk) is a :class:`CheckpointError` naming the file and the cause.
Restoring is all or nothing (``restore.py``). Under a multi-worker strategy only the chief
writes; every worker returns the same path, keeps the same counter, and waits for the chief
at most ``timeout`` seconds (``$DISTRIB_CHECKPOINT_TIMEOUT``, default 1800), a bound of its
own, longer than the collectives' ``CommunicationOptions(timeout_seconds=...)``.

Parts: ``errors.py`` (the error, the timeout), ``fileio.py`` (atomic writes), ``format.py``
(the data file), ``index.py`` (the index, ``latest_checkpoint``, ``checkpoints_iterator``),
``restore.py`` (validation, rollback, the load status), ``core.py`` (``Checkpoint``),
``manager.py`` (``CheckpointManager``). Sharded checkpoints (a directory, each worker writing only
its own shards through ``torch.distributed.checkpoint``, with the same atomicity, checksums and
no-code-on-load guarantees): ``sharded.py`` (``save_sharded``, ``load_sharded``),
``sharded_format.py`` (the JSON manifest), ``sharded_readers.py`` (a tensor whole from its chunks,
the saved structure from the manifest: what every restore of one reads with), ``sharded_export.py``
(``consolidate`` to one file), ``sharded_objects.py`` (``Checkpoint``'s ``<prefix>.dcp``);
they are imported on use, not by ``import distrib``.
"""

from distrib.checkpoint.core import Checkpoint
from distrib.checkpoint.errors import DEFAULT_CHECKPOINT_TIMEOUT, TIMEOUT_ENV, CheckpointError, checkpoint_timeout
from distrib.checkpoint.index import checkpoints_iterator, latest_checkpoint
from distrib.checkpoint.manager import CheckpointManager
from distrib.checkpoint.restore import LoadStatus

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "CheckpointError",
    "LoadStatus",
    "latest_checkpoint",
    "checkpoints_iterator",
    "checkpoint_timeout",
    "DEFAULT_CHECKPOINT_TIMEOUT",
    "TIMEOUT_ENV",
]
