"""Fault scenarios, issue 10 C.7: a malformed ``TF_CONFIG`` is a ``TFConfigError`` naming the field, never a
rendezvous that waits until its timeout, another exception, or a hang.

- ``fuzz``: seeded mutations of valid configs (misspelt and unknown keys, wrong types, bad hosts and
  ports, sparse jobs with bad or duplicate indices, duplicate JSON keys, character edits), parsed in a
  child process bounded in time (and each trial by an alarm). Every one parses to a cluster that an
  independent check finds valid, or raises ``TFConfigError``.
- ``real workers``: both workers of a 2-worker cluster start ``MultiWorkerMirroredStrategy()`` under a
  malformed ``TF_CONFIG`` that used to end in a rendezvous timeout; both exit at once with
  ``TFConfigError`` naming the field.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TOP_KEYS = {"cluster", "task", "rpc_layer", "session_master", "environment", "job"}
TASK_KEYS = {"type", "index", "trial", "cloud"}
ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")

BASES: list[dict] = [
    {"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}},
    {
        "cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
        "task": {"type": "worker", "index": 1},
    },
    {
        "cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222"], "ps": ["10.0.0.3:2222", "10.0.0.4:2222"]},
        "task": {"type": "ps", "index": 1},
        "rpc_layer": "grpc",
    },
    {
        "cluster": {"worker": {"0": "w0.example.com:2222", "3": "w3.example.com:2222"}, "ps": ["[::1]:2222"]},
        "task": {"type": "worker", "index": "3"},
    },
]
JUNK: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    2,
    1.5,
    1e308,
    "1",
    " 2",
    "",
    " ",
    "x",
    "\u0663",
    "1e3",
    "NaN",
    [],
    {},
    [1],
    {"a": 1},
    10**20,
    "worker",
    "localhost:1",
    ["h:1"],
]
TYPOS = {
    "index": ["idx", "Index", "indx", "index "],
    "type": ["typ", "Type", "tpye", "kind"],
    "cluster": ["clusters", "Cluster", "clustr"],
    "task": ["tasks", "Task"],
    "worker": ["workers", "wroker", "Worker"],
    "chief": ["chef", "master"],
    "ps": ["PS", "pss"],
    "rpc_layer": ["rpc", "rpclayer"],
}
HOST_EDITS = [
    lambda a: a.replace(":", " :", 1),
    lambda a: " " + a,
    lambda a: ":" + a.rpartition(":")[2],
    lambda a: a.rpartition(":")[0],
    lambda a: a + "0",
    lambda a: a.rpartition(":")[0] + ":0",
    lambda a: a.rpartition(":")[0] + ":65536",
    lambda a: a.rpartition(":")[0] + ":-1",
    lambda a: a + "a",
    lambda a: "grpc://" + a,
    lambda a: a.replace("o", "\u00f6"),
    lambda a: "::1:2222",
    lambda a: "[::1]:2222",
    lambda a: a.upper(),
    lambda a: a.replace(".", "..", 1),
    lambda a: "a_b-c.d:1",
    lambda a: a.replace(":", "\t:"),
    lambda a: "h/x:1",
    lambda a: a + "\n",
    lambda a: "",
    lambda a: "-" + a,
    lambda a: "999.1.1.1:80",
    lambda a: a.replace(":", "::"),
]
SPARSE_KEYS = ["0", "1", "2", "3", "-1", "a", "01", "1.0", " 1", "00", "", "\u0663"]


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indices) to a value inside ``obj``."""
    found = [path] if path else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _paths(v, path + (i,))
    return found


def _parent(obj: Any, path: tuple) -> Any:
    for key in path[:-1]:
        obj = obj[key]
    return obj


def mutate(rng: random.Random) -> str:
    """One mutated TF_CONFIG: 1-2 structural edits of a valid base, sometimes a character edit on top."""
    config = copy.deepcopy(rng.choice(BASES))
    for _ in range(rng.randint(1, 2)):
        paths = _paths(config)
        op = rng.randrange(9)
        if op == 0:  # misspell a key
            candidates = [p for p in paths if isinstance(p[-1], str) and p[-1] in TYPOS]
            if candidates:
                p = rng.choice(candidates)
                parent = _parent(config, p)
                parent[rng.choice(TYPOS[p[-1]])] = parent.pop(p[-1])
        elif op == 1 and paths:  # a value of the wrong type or range
            p = rng.choice(paths)
            _parent(config, p)[p[-1]] = copy.deepcopy(rng.choice(JUNK))
        elif op == 2:  # edit a host:port
            addresses = [
                p for p in paths if isinstance(_parent(config, p)[p[-1]], str) and ":" in _parent(config, p)[p[-1]]
            ]
            if addresses:
                p = rng.choice(addresses)
                _parent(config, p)[p[-1]] = rng.choice(HOST_EDITS)(_parent(config, p)[p[-1]])
        elif op == 3 and isinstance(config.get("cluster"), dict):  # a sparse job with chosen keys
            job = rng.choice(list(config["cluster"]) or ["worker"])
            tasks = config["cluster"].get(job)
            values = list(tasks.values()) if isinstance(tasks, dict) else list(tasks or ["h:1"])
            config["cluster"][job] = {rng.choice(SPARSE_KEYS): v for v in values}
        elif op == 4 and isinstance(config.get("cluster"), dict):  # two tasks on one address
            addresses = [a for t in config["cluster"].values() if isinstance(t, list) for a in t]
            job = rng.choice(list(config["cluster"]))
            if addresses and isinstance(config["cluster"][job], list):
                config["cluster"][job].append(rng.choice(addresses))
        elif op == 5:  # an unknown key
            target = config["task"] if isinstance(config.get("task"), dict) and rng.random() < 0.5 else config
            target[rng.choice(["rank", "idx", "session", "extra", "trial"])] = rng.choice(JUNK)
        elif op == 6 and paths:  # drop a key or element
            p = rng.choice(paths)
            parent = _parent(config, p)
            del parent[p[-1]]
        elif op == 7:  # benign edits: still valid
            task = config.get("task")
            if isinstance(task, dict) and rng.random() < 0.5:
                task["index"] = str(task.get("index", 0))
            config[rng.choice(["rpc_layer", "environment"])] = rng.choice(["grpc", "cloud", ""])
        else:  # duplicate a JSON key (json.dumps cannot write one: edit the text)
            text = json.dumps(config)
            return (
                text.replace('"task": {', '"task": {"index": 1, ', 1)
                if rng.random() < 0.5
                else text.replace("{", '{"cluster": {}, ', 1)
            )
    text = json.dumps(config, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.2 and text:  # a character edit
        i = rng.randrange(len(text))
        text = rng.choice([text[:i] + text[i + 1 :], text[:i] + rng.choice(' "{}[]:,0a\\\u00e9') + text[i:], text[:i]])
    return text


def _duplicates(text: str) -> bool:
    found = []

    def hook(pairs: list) -> dict:
        keys = [k for k, _ in pairs]
        found.extend(k for k in keys if keys.count(k) > 1)
        return dict(pairs)

    try:
        json.loads(text, object_pairs_hook=hook)
    except Exception:
        return False
    return bool(found)


def invalid_reason(text: str, resolver: Any) -> str | None:
    """Why an accepted TF_CONFIG is not a valid cluster (independently of the parser), or None."""
    if not text.strip():
        return None if not resolver.cluster_spec() and resolver.task_type is None else "blank TF_CONFIG gave a cluster"
    if _duplicates(text):
        return "a duplicate key was accepted"
    raw = json.loads(text)
    if set(raw) - TOP_KEYS or set(raw.get("task") or {}) - TASK_KEYS:
        return "an unknown key was accepted"
    spec = resolver.cluster_spec()
    seen = set()
    for job in spec.jobs:
        if job not in TASK_TYPES:
            return f"unknown job {job!r} accepted"
        if job in ("chief", "evaluator") and spec.num_tasks(job) > 1:
            return f"{spec.num_tasks(job)} {job} tasks accepted"
        for index in spec.task_indices(job):
            address = spec.task_address(job, index)
            m = ADDRESS.fullmatch(address)
            if not isinstance(index, int) or index < 0 or not m or not 0 < int(m.group(3)) < 65536:
                return f"bad task {job}[{index}] = {address!r} accepted"
            if address.lower() in seen:
                return f"duplicate address {address!r} accepted"
            seen.add(address.lower())
    if resolver.task_type is not None:
        if resolver.task_type not in TASK_TYPES or not isinstance(resolver.task_id, int) or resolver.task_id < 0:
            return f"bad task {resolver.task_type!r} {resolver.task_id!r} accepted"
        if resolver.task_type != "evaluator" and resolver.task_id not in spec.task_indices(resolver.task_type):
            return f"task {resolver.task_type} {resolver.task_id} is not in the cluster"
    elif (raw.get("task") or {}).get("index") is not None:
        return "an index without a type was accepted"
    return None


def run_trials(seed: int, trials: int) -> dict:
    """Parse ``trials`` mutations; each bounded by a 10 s alarm. Runs in a child process."""
    from distrib.cluster import TFConfigClusterResolver, TFConfigError

    def timeout(*_: Any) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, timeout)
    rng = random.Random(seed)
    counts = {"valid": 0, "refused": 0, "other": 0, "accepted_invalid": 0, "hang": 0}
    failures = []
    for i in range(trials):
        text = mutate(rng)
        signal.alarm(10)
        try:
            resolver = TFConfigClusterResolver(environ={"TF_CONFIG": text})
            reason = invalid_reason(text, resolver)
            kind, detail = ("accepted_invalid", reason) if reason else ("valid", "")
        except TFConfigError as e:
            kind, detail = ("refused", "") if str(e).startswith("TF_CONFIG") else ("other", f"unnamed: {e}")
        except TimeoutError:
            kind, detail = "hang", "over 10 s"
        except Exception as e:  # noqa: BLE001 - any other exception is the failure this scenario counts
            kind, detail = "other", f"{type(e).__name__}: {e}"
        finally:
            signal.alarm(0)
        counts[kind] += 1
        if detail:
            failures.append({"trial": i, "tf_config": text[:300], "kind": kind, "detail": detail[:300]})
    return {"counts": counts, "failures": failures}


def fuzz(seed: int, trials: int) -> None:
    child = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_tf_config as t; "
        f"print('RESULT ' + json.dumps(t.run_trials({seed}, {trials})))"
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60 + trials)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout + proc.stderr
    result = json.loads(line[len("RESULT ") :])
    c = result["counts"]
    print(
        f"FAULT malformed TF_CONFIG fuzz: {trials} trials, {c['valid']} parsed to a valid cluster, "
        f"{c['refused']} refused with TFConfigError naming the field, {c['other']} other exceptions, "
        f"{c['accepted_invalid']} invalid accepted, {c['hang']} hangs"
    )
    assert c["valid"] + c["refused"] == trials, result["failures"][:5]
    assert c["valid"] and c["refused"]  # the mutations reach both outcomes


@pytest.mark.parametrize(
    "seed, trials",
    [
        (10, 30),
        pytest.param(0, 300, marks=pytest.mark.faults_full),
    ],
)
def test_fuzzed_tf_config_parses_to_a_valid_cluster_or_raises_tf_config_error(seed, trials):
    fuzz(seed, trials)


CLUSTER = {"worker": ["127.0.0.1:{0}", "127.0.0.1:{1}"]}
# each used to end in a rendezvous timeout (or two workers both taking index 0)
REAL_CASES = [
    ({"cluster": CLUSTER, "task": {"type": "worker", "idx": "{i}"}}, "'task.idx' is not a known key"),
    (
        {"cluster": {"worker": ["127.0.0.1:{0}", "127.0.0.1 :{1}"]}, "task": {"type": "worker", "index": "{i}"}},
        "cluster.worker[1]",
    ),
    (
        {
            "cluster": {"worker": {"0": "127.0.0.1:{0}", "-1": "127.0.0.1:{1}"}},
            "task": {"type": "worker", "index": "{i}"},
        },
        "'cluster.worker': the task index '-1'",
    ),
    ({"cluster": {"wroker": CLUSTER["worker"]}, "task": {"type": "worker", "index": "{i}"}}, "'cluster.wroker'"),
    ({"cluster": {"worker": ["127.0.0.1:{0}", ":{1}"]}, "task": {"type": "worker", "index": "{i}"}}, "an empty host"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": "{i}", "rank": "{i}"}}, "'task.rank' is not a known key"),
    (
        {"cluster": {"worker": ["127.0.0.1:{0}", "127.0.0.1:{0}"]}, "task": {"type": "worker", "index": "{i}"}},
        "is also used by",
    ),
    (
        {"cluster": {"worker": ["127.0.0.1:{0}", "127.0.0.1:{1}"]}, "task": {"type": "worker", "index": "{i}{i}"}},
        "'task.index'",
    ),
]


def real_workers(cases: list) -> None:
    from distrib.cluster.launch import free_ports

    refused = hangs = 0
    for template, field in cases:
        ports = free_ports(2)
        procs = []
        start = time.monotonic()
        try:
            for i in range(2):
                text = json.dumps(template).replace("{0}", str(ports[0])).replace("{1}", str(ports[1]))
                text = text.replace('"{i}{i}"', str(i + 5)).replace('"{i}"', str(i))
                env = {**os.environ, "TF_CONFIG": text}
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", "import distrib as ds; ds.MultiWorkerMirroredStrategy()"],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    )
                )
            outs = []
            for p in procs:
                try:
                    outs.append(p.communicate(timeout=60)[0])
                except subprocess.TimeoutExpired:
                    hangs += 1
                    outs.append("")
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p, out in zip(procs, outs):
            if p.returncode not in (0, None) and "TFConfigError" in out and field in out:
                refused += 1
            else:
                print(f"not refused ({field!r}, {time.monotonic() - start:.0f} s):\n{out[-2000:]}")
    print(
        f"FAULT malformed TF_CONFIG in real workers: {len(cases)} configs x 2 workers, {refused} workers refused "
        f"with TFConfigError naming the field, {hangs} hangs"
    )
    assert refused == 2 * len(cases) and hangs == 0


@pytest.mark.parametrize(
    "cases",
    [
        REAL_CASES[:3],
        pytest.param(REAL_CASES, marks=pytest.mark.faults_full),
    ],
)
def test_workers_with_a_malformed_tf_config_stop_at_once_with_tf_config_error(cases):
    real_workers(cases)
