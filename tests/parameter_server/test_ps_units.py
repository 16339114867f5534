"""Parameter-server parts that need no cluster: partitioners (against TF's rules), the wire format,
the failure policy, RemoteValue's transitions, optimizer-state gathering; plus an in-process cluster."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import distrib as ds
from distrib.parameter_server.client.failure_policy import Decision, FailureKind, FailurePolicy
from distrib.parameter_server.client.remote_value import RemoteValue, RemoteValueStatus
from distrib.parameter_server.errors import ScheduledFunctionError, scheduled_function_error
from distrib.parameter_server.optimizer_state import merge_shard_states, split_state
from distrib.parameter_server.partitioners import shard_offsets
from distrib.parameter_server.transport import wire
from distrib.parameter_server.variables import Placer, split_gradient


# --------------------------------------------------------------------------- partitioners vs TF
# Transcribed from TF's source (tensorflow/python/ops/partitioned_variables.py, used by
# tensorflow/python/distribute/sharded_variable.py), as the oracle.
def tf_fixed(num_shards, shape):
    return min(num_shards, shape[0])


def tf_min_max(max_partitions, min_slice_size, shape, element_size):
    total = math.prod(shape) * element_size
    return max(1, min(shape[0], max_partitions, int(math.ceil(total / min_slice_size))))


def tf_axis_size(max_shard_bytes, max_shards, shape, element_size):
    bytes_per_slice = 1.0 * (math.prod(shape) / shape[0]) * element_size
    slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
    shards = int(math.ceil(1.0 * shape[0] / slices_per_shard))
    return min(max_shards, shards) if max_shards else shards


# (partitioner, shape, dtype, shards): TF's documented examples and hand-checked cases.
TABLE = [
    (ds.partitioners.FixedShardsPartitioner(2), (10, 3), torch.float32, 2),
    (ds.partitioners.FixedShardsPartitioner(4), (3, 8), torch.float32, 3),
    (ds.partitioners.FixedShardsPartitioner(5), (7,), torch.int64, 5),
    (ds.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), torch.float32, 2),
    (ds.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), torch.float32, 6),
    (ds.partitioners.MinSizePartitioner(), (1024, 1024), torch.float32, 1),
    (ds.partitioners.MinSizePartitioner(256 << 10, max_shards=8), (1024, 1024), torch.float32, 8),
    (ds.partitioners.MinSizePartitioner(256 << 10, max_shards=100), (1024, 1024), torch.float32, 16),
    (ds.partitioners.MinSizePartitioner(1 << 20, max_shards=10), (100, 10), torch.float32, 1),
    (ds.partitioners.MinSizePartitioner(10, max_shards=10), (3, 7), torch.float64, 3),
    (ds.partitioners.MinSizePartitioner(8, max_shards=100), (10, 2), torch.float16, 5),
    (ds.partitioners.MaxSizePartitioner(max_shard_bytes=4), (6, 1), torch.float32, 6),
    (ds.partitioners.MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), torch.float32, 2),
    (ds.partitioners.MaxSizePartitioner(max_shard_bytes=1024), (6, 1), torch.float32, 1),
    (ds.partitioners.MaxSizePartitioner(100), (10, 10), torch.float32, 5),
    (ds.partitioners.MaxSizePartitioner(1), (5, 3), torch.float32, 5),
    (ds.partitioners.MaxSizePartitioner((64 << 20) - 1), (1_000_000, 128), torch.float32, 8),
    (ds.partitioners.MaxSizePartitioner(1000, max_shards=3), (100, 4), torch.int64, 3),
]


@pytest.mark.parametrize("partitioner,shape,dtype,shards", TABLE, ids=[f"{p!r}-{s}-{d}" for p, s, d, _ in TABLE])
def test_partitioner_shard_counts_equal_tfs(partitioner, shape, dtype, shards):
    assert partitioner(shape, dtype) == [shards] + [1] * (len(shape) - 1)


def test_partitioners_match_tf_formulas_over_a_grid():
    shapes = [(1,), (7,), (6, 1), (10, 3), (33, 17), (1000, 8), (4096, 64, 2), (100_000, 16)]
    for shape in shapes:
        for dtype in (torch.float32, torch.float64, torch.float16, torch.int8):
            size = torch.empty((), dtype=dtype).element_size()
            for n in (1, 2, 3, 8, 50):
                assert ds.partitioners.FixedShardsPartitioner(n)(shape, dtype)[0] == tf_fixed(n, shape)
            for min_bytes in (1, 4, 100, 4096, 256 << 10):
                for max_shards in (1, 2, 7, 1000):
                    got = ds.partitioners.MinSizePartitioner(min_bytes, max_shards)(shape, dtype)[0]
                    assert got == tf_min_max(max_shards, min_bytes, shape, size), (shape, dtype, min_bytes, max_shards)
            for max_bytes in (1, 4, 100, 4096, 1 << 20):
                for max_shards in (None, 1, 3, 1000):
                    got = ds.partitioners.MaxSizePartitioner(max_bytes, max_shards)(shape, dtype)[0]
                    assert got == tf_axis_size(max_bytes, max_shards, shape, size), (
                        shape,
                        dtype,
                        max_bytes,
                        max_shards,
                    )


def test_partitioner_arguments_are_validated():
    with pytest.raises(ValueError, match="min_shard_bytes"):
        ds.partitioners.MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match="max_shards"):
        ds.partitioners.MaxSizePartitioner(10, max_shards=0)
    with pytest.raises(ValueError, match="num_shards"):
        ds.partitioners.FixedShardsPartitioner(0)


def test_shards_split_rows_like_tf_div_and_go_round_robin():
    assert shard_offsets(10, 4) == [0, 3, 6, 8, 10]
    placer = Placer(num_ps=2, partitioner=ds.partitioners.FixedShardsPartitioner(3), prefix="t")
    w = placer.place("w", torch.zeros(10, 4))
    b = placer.place("b", torch.zeros(()))  # scalars are never partitioned
    e = placer.place("e", torch.zeros(2, 4))
    assert [(s.ps, s.start, s.stop) for s in w.shards] == [(0, 0, 4), (1, 4, 7), (0, 7, 10)]
    assert [s.ps for s in b.shards] == [1]
    assert [(s.ps, s.start, s.stop) for s in e.shards] == [(0, 0, 1), (1, 1, 2)]


def test_sparse_gradient_keeps_only_each_shards_touched_rows():
    spec = Placer(2, ds.partitioners.FixedShardsPartitioner(2), "t").place("e", torch.zeros(6, 2))
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 4, 1]]), torch.ones(3, 2), (6, 2), check_invariants=False)
    first, second = split_gradient(spec, grad)
    assert first.coalesce().indices().tolist() == [[1]] and first.coalesce().values().tolist() == [[2.0, 2.0]]
    assert second.coalesce().indices().tolist() == [[1]]  # row 4 is row 1 of the second shard
    only_first = split_gradient(
        spec, torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 2), (6, 2), check_invariants=False)
    )
    assert only_first[1] is None


# --------------------------------------------------------------------------- wire format
def test_wire_round_trips_tensors_as_raw_bytes_and_structures():
    value = {
        "dense": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 5),
        "bool": torch.tensor([True, False]),
        "sparse": torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2, 3), (4, 3), check_invariants=False),
        "nested": [1, 2.5, "s", None, (True, b"raw")],
        "numpy": np.arange(3),
        "nan": float("nan"),
        3: "int key",
    }
    out = wire.decode(wire.encode(value))
    assert torch.equal(out["dense"], value["dense"]) and out["half"].dtype == torch.bfloat16
    assert out["scalar"].shape == () and int(out["scalar"]) == 7 and out["empty"].shape == (0, 5)
    assert torch.equal(out["sparse"].to_dense(), value["sparse"].to_dense())
    assert out["nested"] == [1, 2.5, "s", None, (True, b"raw")] and out[3] == "int key"
    assert list(out["numpy"]) == [0, 1, 2] and math.isnan(out["nan"])
    out["dense"][0, 0] = 5.0  # decoded tensors are writable
    assert b"pickle" not in wire.encode(torch.ones(2))  # no pickle opcodes: header is JSON


def test_wire_refuses_what_it_cannot_send():
    with pytest.raises(wire.WireError, match="cannot send a value of type object"):
        wire.encode({"x": object()})
    with pytest.raises(wire.WireError, match="bad magic"):
        wire.decode(b"\x80\x04pickle")


# --------------------------------------------------------------------------- policy, remote values, errors
def test_failure_policy_retries_lost_workers_and_raises_the_rest():
    policy = FailurePolicy()
    assert policy.decide(FailureKind.WORKER_LOST, attempts=10) is Decision.RETRY
    assert policy.decide(FailureKind.FUNCTION_ERROR, attempts=1) is Decision.RAISE
    assert policy.decide(FailureKind.PS_LOST, attempts=1) is Decision.RAISE_FATAL
    assert FailurePolicy(max_attempts=2).decide(FailureKind.WORKER_LOST, attempts=2) is Decision.RAISE


def test_remote_value_allows_only_documented_transitions():
    rv = RemoteValue()
    rv.transition(RemoteValueStatus.RUNNING)
    rv.transition(RemoteValueStatus.PENDING)  # worker lost: back to the queue
    rv.transition(RemoteValueStatus.RUNNING)
    assert rv.attempts == 2
    rv.transition(RemoteValueStatus.READY, value=torch.ones(1))
    assert rv.fetch().item() == 1.0
    with pytest.raises(RuntimeError, match="cannot go from READY to RUNNING"):
        rv.transition(RemoteValueStatus.RUNNING)
    pending = RemoteValue()
    with pytest.raises(RuntimeError, match="PENDING to READY"):
        pending.transition(RemoteValueStatus.READY)
    with pytest.raises(TimeoutError):
        pending.fetch(timeout=0.01)


def test_remote_errors_keep_builtin_class_and_traceback():
    error = scheduled_function_error(
        "KeyError", "'x'", 'Traceback ...\n  File "train.py", line 3', "/job:worker/task:1"
    )
    assert isinstance(error, KeyError) and isinstance(error, ScheduledFunctionError)
    assert "train.py" in str(error) and error.worker == "/job:worker/task:1"
    custom = scheduled_function_error("MyError", "m", "tb", "w")
    assert type(custom) is ScheduledFunctionError


def test_optimizer_state_gathers_whole_tensors_and_splits_back():
    spec = Placer(2, ds.partitioners.FixedShardsPartitioner(2), "t").place("e", torch.zeros(5, 2))
    shards = [
        {"step": torch.tensor(3.0), "sum": torch.ones(3, 2)},
        {"step": torch.tensor(5.0), "sum": torch.zeros(2, 2)},
    ]
    merged = merge_shard_states(spec, shards)
    assert merged["step"].item() == 5.0 and merged["sum"].shape == (5, 2) and merged["sum"][:3].sum() == 6
    back = split_state(spec, merged)
    assert torch.equal(back[0]["sum"], torch.ones(3, 2)) and back[1]["sum"].shape == (2, 2)
    lazily = merge_shard_states(spec, [{"exp_avg": torch.ones(3, 2)}, {}])  # a shard never updated
    assert lazily["exp_avg"][3:].abs().sum() == 0


# --------------------------------------------------------------------------- in-process cluster (threads)
def test_in_process_cluster_runs_the_seed_notebook_flow():
    resolver = ds.testing.create_in_process_cluster(num_workers=2, num_ps=2)
    try:
        strategy = ds.ParameterServerStrategy(resolver)
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Sequential(torch.nn.Linear(2, 1))
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
        coordinator = ds.coordinator.ClusterCoordinator(strategy)
        assert ds.coordinator.ClusterCoordinator(strategy) is coordinator  # one per strategy
        assert {p[0][0] for p in strategy.variable_placement(model).values()} == {0, 1}  # round robin
        x, y = torch.tensor([[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]]), torch.tensor([[0.3], [0.5], [0.7]])

        def replica_fn(x, y):
            loss = ds.compute_average_loss(torch.nn.functional.mse_loss(model(x), y, reduction="none").mean(1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        def step(x, y):
            per_replica = strategy.run(replica_fn, args=(x, y))
            return strategy.reduce(ds.ReduceOp.SUM, per_replica, axis=None)

        start = torch.nn.functional.mse_loss(model(x), y).item()
        losses = coordinator.fetch([coordinator.schedule(step, args=(x, y)) for _ in range(30)])
        coordinator.join()
        assert coordinator.done() and len(losses) == 30
        assert torch.nn.functional.mse_loss(model(x), y).item() < start
        assert int(optimizer.state_dict()["state"][0]["step"]) == 30
        # a learning-rate change on the coordinator reaches the ps tasks with the next calls
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        frozen = {k: v.clone() for k, v in model.state_dict().items()}
        coordinator.fetch([coordinator.schedule(step, args=(x, y)) for _ in range(5)])
        assert all(torch.equal(v, frozen[k]) for k, v in model.state_dict().items())
        assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.0
    finally:
        ds.testing.stop_in_process_cluster(resolver)


# --------------------------------------------------------------------------- TLS and the token (in-process)
def _make_certificates(directory):
    x509 = pytest.importorskip("cryptography.x509")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    def key_and_cert(name, issuer_name=None, issuer_key=None, ca=False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return key, cert

    ca_key, ca_cert = key_and_cert("distrib test CA", ca=True)
    paths = {}
    for name in ("task", "intruder"):
        signer = (ca_cert.subject, ca_key) if name == "task" else (None, None)
        key, cert = key_and_cert(name, *signer)
        paths[name] = (str(directory / f"{name}.crt"), str(directory / f"{name}.key"))
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    (directory / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return paths, str(directory / "ca.crt")


TOKEN = "0123456789abcdef-secret"


def test_mutual_tls_and_token_are_both_required(tmp_path):
    from distrib.parameter_server.errors import AuthenticationError, PeerUnavailableError
    from distrib.parameter_server.transport.rpc import Connection, TLSConfig

    paths, ca = _make_certificates(tmp_path)
    tls = TLSConfig(*paths["task"], ca_file=ca)
    address = f"localhost:{ds.testing.pick_unused_port()}"
    server = ds.Server({"ps": [address], "worker": ["localhost:1"]}, "ps", 0, token=TOKEN, tls=tls)
    try:
        health = wire.encode({})
        ok = Connection(address, "distrib.ParameterServer", TOKEN, tls)
        assert wire.decode(ok.call("Health", health, timeout=10))["ok"]
        ok.close()
        refused = [
            Connection(address, "distrib.ParameterServer", TOKEN, None),  # plaintext
            Connection(address, "distrib.ParameterServer", TOKEN, TLSConfig(*paths["intruder"], ca_file=ca)),
        ]
        for conn in refused:
            with pytest.raises(PeerUnavailableError):
                conn.call("Health", health, timeout=5)
            conn.close()
        wrong_token = Connection(address, "distrib.ParameterServer", "guess", tls)
        with pytest.raises(AuthenticationError, match="DISTRIB_CLUSTER_TOKEN"):
            wrong_token.call("Health", health, timeout=10)
        wrong_token.close()
    finally:
        server.stop(grace=0)


def test_server_refuses_to_start_without_a_token_or_on_a_foreign_address(monkeypatch):
    monkeypatch.delenv("DISTRIB_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ValueError, match="DISTRIB_CLUSTER_TOKEN"):
        ds.Server({"ps": ["localhost:2222"], "worker": ["localhost:2223"]}, "ps", 0)
    with pytest.raises(ValueError, match="only 'ps' and 'worker'"):
        ds.Server({"ps": ["localhost:2222"], "chief": ["localhost:2224"]}, "chief", 0, token=TOKEN)
    with pytest.raises(OSError, match="cannot listen on '192.0.2.1:2222'"):
        ds.Server({"ps": ["192.0.2.1:2222"], "worker": ["localhost:2223"]}, "ps", 0, token=TOKEN)


def test_examples_run_on_an_in_process_cluster():
    import sys
    from pathlib import Path

    from helpers import run_bounded

    examples = Path(__file__).resolve().parents[2] / "examples"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    env.pop("TF_CONFIG", None)
    code, out, _ = run_bounded(
        [sys.executable, str(examples / "parameter_server.py"), "--epochs", "2", "--steps-per-epoch", "5"],
        timeout=120,
        env=env,
    )
    assert code == 0, out[-3000:]
    assert "Epoch 2/2" in out and "{'loss':" in out
    code, out, _ = run_bounded(
        [sys.executable, str(examples / "embedding_ps.py"), "--rows", "5000", "--steps", "10"], timeout=120, env=env
    )
    assert code == 0, out[-3000:]
    assert "KB per step" in out and "held-out log loss" in out
