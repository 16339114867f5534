"""``SlurmClusterResolver``: a cluster from the variables ``srun`` sets for each task, as TF reads them.

Read (TF's step variables first, then the job's):

- ``SLURM_PROCID``: this task's rank in the step;
- ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``): how many tasks, when ``jobs`` is not given;
- ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``): the nodes, in order;
- ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``): e.g. ``"3(x2),2,1"``;
- ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``: the ports of this job step, when neither
  ``port_base`` nor ``MASTER_PORT`` is given (see :func:`default_port_base`);
- ``MASTER_PORT``: when set (as PyTorch's Slurm recipes export it), the first port on each node;
- ``SLURMD_NODENAME``, ``SLURM_LOCALID`` when set: checked against the layout computed.

Tasks are laid out block by block in node order (Slurm's default distribution): the
first node's tasks get ranks 0..k-1 and ports ``port_base``, ``port_base+1``, ...; ranks
are then given to the jobs in the order of their sorted names (``{"ps": 1, "worker": 2}``:
rank 0 is ps 0, ranks 1-2 are workers 0-1), as TF does.

Ports differ from TF's, which always starts at 8888: two job steps on one node (two ``srun``
of one allocation, or two jobs sharing a node) then both listened on 8888, and the second
step's chief failed with ``EADDRINUSE`` or, worse, its workers joined the first step's
rendezvous. Here each (job, step) gets its own block of ports.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Mapping, MutableMapping

from distrib.cluster.resolver import ClusterResolver
from distrib.cluster.spec import TASK_TYPES, ClusterSpec, parse_address

__all__ = ["SlurmClusterResolver", "default_port_base", "expand_hostlist", "expand_tasks_per_node"]

_MAX_HOSTS = 1 << 16
_DEFAULT_PORT_BASE = 8888  # TF's; the first block of ports (job 0, step 0)
_PORT_LIMIT = 32768  # the blocks end below Linux's ephemeral ports (32768-60999), which gloo and clients use
_PORT_BLOCK = 16  # ports per block; a step with more tasks on a node takes several blocks
_JOB_STRIDE = 37  # blocks between consecutive jobs: any step < 37 of job j and any step of job j+1 differ


def default_port_base(job_id: int, step_id: int, tasks_per_node: int = 1) -> int:
    """The first port of job step ``step_id`` of job ``job_id`` on each node, when neither ``port_base``
    nor ``MASTER_PORT`` is given: ``8888 + width * ((37 * job_id + step_id) % (23880 // width))``,
    where ``width`` is ``tasks_per_node`` rounded up to a multiple of 16.

    The ports ``base .. base + tasks_per_node - 1`` lie in 8888..32767, below Linux's ephemeral
    range. Concurrent steps of one job never share a port (up to 1492 steps for 16 tasks a node),
    nor do the same steps of the next jobs (in Slurm's job order); other jobs may, rarely: then
    give ``port_base`` or ``MASTER_PORT``. Without job and step ids (0, 0) this is TF's 8888.

    Example::

        >>> default_port_base(0, 0), default_port_base(4242, 0), default_port_base(4242, 1)
        (8888, 13592, 13608)
        >>> default_port_base(4242, 1, tasks_per_node=20)  # blocks of 32 ports
        18328
    """
    width = _PORT_BLOCK * -(-max(tasks_per_node, 1) // _PORT_BLOCK)
    slots = (_PORT_LIMIT - _DEFAULT_PORT_BASE) // width
    if slots < 1:
        raise ValueError(f"{tasks_per_node} tasks per node need more ports than 8888..32767 hold; pass port_base")
    return _DEFAULT_PORT_BASE + width * ((_JOB_STRIDE * job_id + step_id) % slots)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list, in order: ``"n[01-03,07],gpu5"`` -> n01, n02, n03, n07, gpu5.

    Zero padding is kept; several ranges in one name (``"r[1-2]n[1-2]"``) are expanded in order.

    Example::

        >>> expand_hostlist("n[1-2],m5,o[009-011]")
        ['n1', 'n2', 'm5', 'o009', 'o010', 'o011']
    """
    hosts: list[str] = []
    for part in _split_outside_brackets(hostlist):
        names = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", part):
            values = _expand_ranges(ranges, hostlist) if ranges else [""]
            names = [name + literal + value for name in names for value in values]
            if len(hosts) + len(names) > _MAX_HOSTS:
                raise ValueError(f"invalid Slurm host list {hostlist!r}: more than {_MAX_HOSTS} hosts")
        hosts.extend(names)
    return hosts


def _split_outside_brackets(hostlist: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for c in hostlist:
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"invalid Slurm host list {hostlist!r}: unbalanced brackets")
        if c == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += c
    if depth:
        raise ValueError(f"invalid Slurm host list {hostlist!r}: unbalanced brackets")
    parts.append(current)
    if not all(parts):
        raise ValueError(f"invalid Slurm host list {hostlist!r}: an empty host name")
    return parts


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    values: list[str] = []
    for r in ranges.split(","):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", r)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"invalid Slurm host list {hostlist!r}: bad range {r!r} (expected e.g. 01-04 or 7)")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) - int(lo) >= _MAX_HOSTS:
            raise ValueError(f"invalid Slurm host list {hostlist!r}: range {r!r} has more than {_MAX_HOSTS} hosts")
        values += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return values


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand Slurm's tasks-per-node list, in node order: ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``.

    Example::

        >>> expand_tasks_per_node("3(x2),2,11(x4)")
        [3, 3, 2, 11, 11, 11, 11]
    """
    result: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*([0-9]{1,6})(?:\(x([0-9]{1,6})\))?\s*", part)
        if not m:
            raise ValueError(
                f"invalid Slurm tasks-per-node list {tasks_per_node!r}: bad part {part!r} (expected e.g. '3(x2),2,1')"
            )
        result += [int(m.group(1))] * int(m.group(2) or 1)
        if len(result) > _MAX_HOSTS:
            raise ValueError(f"invalid Slurm tasks-per-node list {tasks_per_node!r}: more than {_MAX_HOSTS} nodes")
    return result


def _count_gpus(env: Mapping[str, str]) -> int:
    """GPUs on this node: ``CUDA_VISIBLE_DEVICES`` if set (``""``: none), else ``nvidia-smi -L``, else 0."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


class SlurmClusterResolver(ClusterResolver):
    """A cluster from Slurm's variables (``tf.distribute.cluster_resolver.SlurmClusterResolver``).

    Every task of the job step (started by ``srun``) reads the same variables (``SLURM_PROCID``,
    ``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``, ...) and lists the same cluster: the tasks in node
    order, block by block, node *n*'s *k*-th task at ``host:port_base + k``. Unlike TF's, the default ports
    are a block of this job step's own, so that concurrent steps on a node do not collide (TF: always 8888).

    Parameter servers: ``jobs={"chief": 1, "ps": 1, "worker": 2}`` with ``srun -n 4``; rank 0
    (the chief) runs the coordinator, the others ``ds.Server(...).join()``. A process started
    in an allocation of several tasks or nodes but outside ``srun`` is refused at once.

    Args:
        jobs: job name -> task count, taken in that (sorted) order from the step's tasks; None: every task
            a ``worker``.
        port_base: the first port on each node; None: ``MASTER_PORT`` when set, else a block of ports of this
            job step's own (:func:`default_port_base`).
        gpus_per_node: GPUs on each node; None: counted (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``).
        gpus_per_task: GPUs each task gets; None: an even share of ``gpus_per_node``.
        tasks_per_node: tasks on each node, an int or a dict host -> count; None: Slurm's
            (``SLURM_STEP_TASKS_PER_NODE``).
        auto_set_gpu: ``cluster_spec()`` sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs, as TF does (GPU
            *k* is the *k*-th already visible one when Slurm has narrowed ``CUDA_VISIBLE_DEVICES``).
        rpc_layer: the protocol ``master()`` prefixes.
        environ: the variables to read (distrib's); None: ``os.environ``.

    Raises:
        RuntimeError: the process is not inside an ``srun`` job step, or the variables, ``jobs`` and
            ``tasks_per_node`` disagree (task counts, the task's rank or node), or more GPUs are asked per
            node than there are.
        ValueError: ``port_base`` (or ``MASTER_PORT``) leaves no room for this node's tasks, ``jobs`` names an
            unknown job, or a ``tasks_per_node`` count or a job's count is not a non-negative integer.

    Example (``srun -N 2 --ntasks-per-node 2 python train.py``, task 3)::

        >>> r = SlurmClusterResolver(environ={"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
        ...     "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
        >>> r.cluster_spec()
        ClusterSpec({'worker': ['node01:8888', 'node01:8889', 'node02:8888', 'node02:8889']})
        >>> r.task_type, r.task_id, r.master(), r.rendezvous_address()
        ('worker', 3, 'grpc://node02:8889', 'node01:8888')
        >>> ps = SlurmClusterResolver(jobs={"chief": 1, "ps": 1, "worker": 2}, environ={"SLURM_JOB_ID": "4242",
        ...     "SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
        ...     "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
        >>> ps.cluster_spec().as_dict(), ps.task_type, ps.task_id, ps.port_base
        ({'chief': ['node01:13608'], 'ps': ['node01:13609'], 'worker': ['node02:13608', 'node02:13609']}, 'ps', 0, 13608)
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int | None = None,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env: Mapping[str, str] = os.environ if environ is None else environ
        self._env = env
        in_step = "SLURM_STEP_NODELIST" in env or "SLURM_STEP_NUM_TASKS" in env
        step_tasks = _int_var(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        if not in_step:
            nodes = _int_var(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
            if (step_tasks or 1) > 1 or (nodes or 1) > 1:
                raise RuntimeError(
                    f"this process runs in a Slurm allocation of {step_tasks or '?'} task(s) on {nodes or '?'} "
                    "node(s) but not inside a job step (SLURM_STEP_NODELIST is not set): start every task with "
                    "srun, e.g. `srun python train.py` in the batch script. Started directly, this process is the "
                    "only task: the others would never come and the job would wait for its whole timeout"
                )
        if "SLURM_PROCID" not in env:
            raise RuntimeError("SLURM_PROCID is not set: not inside a Slurm job step; start the tasks with srun")
        rank = _int_var(env, "SLURM_PROCID")
        assert rank is not None
        config = self._task_configuration(env, tasks_per_node)
        num_tasks = sum(config.values())
        if step_tasks is not None and step_tasks != num_tasks:
            raise RuntimeError(
                f"SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) is {step_tasks} but the tasks per node add up "
                f"to {num_tasks} ({_describe(config)}); pass tasks_per_node to match the step"
            )
        jobs = _check_jobs({"worker": num_tasks} if jobs is None else jobs)
        if sum(jobs.values()) != num_tasks:
            raise RuntimeError(
                f"Requested {sum(jobs.values())} tasks (jobs={dict(jobs)}) but Slurm assigned "
                f"{num_tasks} ({_describe(config)}); make them agree"
            )
        if not 0 <= rank < num_tasks:
            raise RuntimeError(f"SLURM_PROCID={rank} is out of range for the {num_tasks} tasks of this step")
        max_per_node = max(config.values())
        port_base = _port_base(env, port_base, max_per_node)
        if gpus_per_node is None:
            gpus_per_node = _count_gpus(env)
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_per_node
        if max_per_node * gpus_per_task > gpus_per_node:
            raise RuntimeError(
                f"Requested more GPUs per node than available: {max_per_node} tasks per node x "
                f"gpus_per_task={gpus_per_task} > gpus_per_node={gpus_per_node}"
            )
        # GPU k of a node is the k-th visible one: Slurm may have made only some visible (e.g. "4,5,6,7")
        visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        names = visible if len(visible) >= max_per_node * gpus_per_task else [str(g) for g in range(gpus_per_node)]
        tasks: list[str] = []
        gpus: list[str] = []
        hosts: list[tuple[str, int]] = []
        for host, count in config.items():
            for k in range(count):
                tasks.append(f"{host}:{port_base + k}")
                gpus.append(",".join(names[k * gpus_per_task : (k + 1) * gpus_per_task]))
                hosts.append((host, k))
        self._check_placement(env, rank, *hosts[rank])
        cluster: dict[str, list[str]] = {}
        start = 0
        for job, count in sorted(jobs.items()):
            cluster[job] = tasks[start : start + count]
            if start <= rank < start + count:
                self.task_type, self.task_id = job, rank - start
            start += count
        try:
            self._spec = ClusterSpec(cluster)
        except ValueError as e:
            raise RuntimeError(f"the Slurm variables give a malformed cluster: {e}") from None
        self._rank = rank
        self._jobs = dict(jobs)
        self._port_base = port_base
        self._gpus_per_node, self._gpus_per_task = gpus_per_node, gpus_per_task
        self._gpu_allocation = gpus
        self._auto_set_gpu = auto_set_gpu
        self._rpc_layer = rpc_layer

    @staticmethod
    def _task_configuration(env: Mapping[str, str], tasks_per_node: int | Mapping[str, int] | None) -> dict[str, int]:
        """Host -> number of tasks on it, in node order."""
        if isinstance(tasks_per_node, Mapping):
            config = dict(tasks_per_node)
        else:
            name, nodelist = _var(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            try:
                hosts = expand_hostlist(nodelist)
            except ValueError as e:
                raise RuntimeError(f"{name}={nodelist!r}: {e}") from None
            if tasks_per_node is not None:
                config = {host: tasks_per_node for host in hosts}
            else:
                counts_name, counts_text = _var(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                try:
                    counts = expand_tasks_per_node(counts_text)
                except ValueError as e:
                    raise RuntimeError(f"{counts_name}={counts_text!r}: {e}") from None
                if len(counts) != len(hosts):
                    raise RuntimeError(
                        f"{counts_name}={counts_text!r} gives {len(counts)} node(s) but "
                        f"{name}={nodelist!r} lists {len(hosts)}"
                    )
                config = dict(zip(hosts, counts))
        for host, count in config.items():
            parse_address(f"{host}:1", f"Slurm node {host!r}")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(
                    f"SlurmClusterResolver(tasks_per_node=...): the count for {host!r} must be a "
                    f"non-negative integer, got {count!r}"
                )
        if not config or not sum(config.values()):
            raise RuntimeError(f"the Slurm step has no tasks ({_describe(config)})")
        return config

    @staticmethod
    def _check_placement(env: Mapping[str, str], rank: int, host: str, local: int) -> None:
        """Refuse a layout that does not match where Slurm really put this task (e.g. cyclic distribution)."""
        node, local_id = env.get("SLURMD_NODENAME"), env.get("SLURM_LOCALID")
        wrong = []
        if node and node.split(".")[0] != host.split(".")[0]:
            wrong.append(f"on node {node!r}, not {host!r}")
        if local_id is not None and local_id.strip().isdigit() and int(local_id) != local:
            wrong.append(f"local task {local_id}, not {local}")
        if wrong:
            raise RuntimeError(
                f"SLURM_PROCID={rank} runs {' and '.join(wrong)}: the tasks are not laid out block by block in "
                "node order. Use `srun --distribution=block` (the default), or give tasks_per_node to match"
            )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SlurmClusterResolver:
        """This resolver read from ``environ``, as ``resolve()`` builds it.

        Args:
            environ: the variables to read; None: ``os.environ``.

        Returns:
            ``SlurmClusterResolver(environ=environ)``, with the defaults of every other argument.

        Raises:
            RuntimeError: not inside an ``srun`` job step, or the variables disagree (see the class).
        """
        return cls(environ=environ)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``environ`` is a Slurm job's (how ``resolve()`` picks this resolver).

        Args:
            environ: the variables to look at; None: ``os.environ``.

        Returns:
            True inside an ``srun`` job step, and in an allocation of several tasks or nodes started without
            srun (the constructor then says to use srun, at once); False elsewhere.
        """
        env = os.environ if environ is None else environ
        if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_STEP_NODELIST" in env):
            return True
        if "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
            return False
        several = [
            env.get(name, "").strip()
            for name in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
        ]
        return any(value not in ("", "0", "1") for value in several)

    def cluster_spec(self) -> ClusterSpec:
        """The cluster; with ``auto_set_gpu``, also sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs (as TF).

        Setting it after CUDA was initialised only affects processes started later: a ``RuntimeWarning``
        says so.

        Returns:
            The jobs' tasks, ``host:port`` each, in node order.
        """
        if self._auto_set_gpu and self._gpus_per_task > 0:
            visible = self._gpu_allocation[self._rank]
            torch = sys.modules.get("torch")
            if self._env.get("CUDA_VISIBLE_DEVICES") != visible and torch is not None and torch.cuda.is_initialized():
                warnings.warn(
                    f"SlurmClusterResolver sets CUDA_VISIBLE_DEVICES={visible} after CUDA was initialised: "
                    "it takes effect only in processes started later. Create the resolver (or the "
                    "strategy) before any CUDA call, or pass auto_set_gpu=False and pick devices yourself",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if isinstance(self._env, MutableMapping):
                self._env["CUDA_VISIBLE_DEVICES"] = visible
        return self._spec

    @property
    def port_base(self) -> int:
        """The first port on each node: node *n*'s *k*-th task listens on ``port_base + k`` (distrib's)."""
        return self._port_base

    def get_task_info(self) -> tuple[str | None, int | None]:
        """This process's task (TF's ``SlurmClusterResolver.get_task_info``).

        Returns:
            ``(task_type, task_id)``: its job and its index in that job.
        """
        return self.task_type, self.task_id

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: object = None
    ) -> dict[str, int]:
        """The GPUs each task gets.

        Args:
            task_type: unused, as in TF.
            task_id: unused, as in TF.
            config_proto: unused, as in TF.

        Returns:
            ``{"GPU": gpus_per_task}``.
        """
        return {"GPU": self._gpus_per_task}


def _port_base(env: Mapping[str, str], port_base: int | None, max_per_node: int) -> int:
    """``port_base`` if given, else ``MASTER_PORT``, else this job step's own block (:func:`default_port_base`)."""
    where = f"SlurmClusterResolver(port_base={port_base!r})"
    if port_base is None and env.get("MASTER_PORT", "").strip():
        port_base = _int_var(env, "MASTER_PORT")
        where = f"MASTER_PORT={env['MASTER_PORT']!r}"
    if port_base is None:
        job = _int_var(env, "SLURM_JOB_ID", "SLURM_JOBID") or 0
        step = _step_id(env)
        return default_port_base(job, step, max_per_node)
    if isinstance(port_base, bool) or not isinstance(port_base, int) or not 0 < port_base <= 65536 - max_per_node:
        raise ValueError(
            f"{where}: the ports of this node's {max_per_node} task(s) would run from {port_base!r} to "
            f"{port_base!r}+{max_per_node - 1}; need 1 <= port and port + {max_per_node - 1} <= 65535"
        )
    return port_base


def _step_id(env: Mapping[str, str]) -> int:
    """``SLURM_STEP_ID``; Slurm's special steps (batch, extern, interactive: 0xfffffffX) count as 0."""
    step = _int_var(env, "SLURM_STEP_ID", "SLURM_STEPID") or 0
    return 0 if step >= 0xFFFFFFF0 else step


def _var(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    raise RuntimeError(
        f"{names[0]} is not set (nor {', '.join(names[1:])}): not inside a Slurm job step? Start the tasks with srun"
    )


def _int_var(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        text = env.get(name, "").strip()
        if text:
            if not text.isascii() or not text.isdigit():
                raise RuntimeError(f"{name}={env[name]!r} is not a non-negative integer")
            return int(text)
    return None


def _check_jobs(jobs: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(jobs, Mapping) or not jobs:
        raise ValueError(
            f"SlurmClusterResolver(jobs={jobs!r}): expected a dict of job name -> task count, "
            "e.g. {'ps': 1, 'worker': 2}"
        )
    for job, count in jobs.items():
        if job not in TASK_TYPES:
            raise ValueError(f"SlurmClusterResolver(jobs=...): unknown job {job!r}; use {', '.join(TASK_TYPES)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"SlurmClusterResolver(jobs=...): the count of {job!r} must be a non-negative integer, got {count!r}"
            )
    return dict(jobs)


def _describe(config: Mapping[str, int]) -> str:
    return ", ".join(f"{host}: {count}" for host, count in config.items()) or "no nodes"
