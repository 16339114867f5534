"""How a scheduled function travels to a worker: cloudpickle plus persistent ids plus raw tensors."""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch

from distrib.parameter_server.transport import pickling, wire


def _no_shared(obj: object) -> None:
    return None


def test_a_closure_round_trips_with_its_captured_tensor_as_raw_bytes():
    weight = torch.arange(6.0).reshape(2, 3).requires_grad_()
    scale = 2.5

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x @ weight.T) * scale

    payload = pickling.dumps(fn, _no_shared)
    message = wire.decode(payload.data)
    assert weight.detach().numpy().tobytes() not in message["pickle"]  # the tensor is beside the pickle
    assert len(message["tensors"]) == 1
    loaded = pickling.loads(payload.data, lambda pid: pytest.fail(f"unexpected persistent id {pid}"))
    x = torch.ones(4, 3)
    assert torch.equal(loaded(x), fn(x).detach()) and loaded.__closure__ is not None


def test_a_parameter_stays_a_parameter_and_keeps_requires_grad():
    p, frozen = torch.nn.Parameter(torch.ones(2)), torch.zeros(3)
    loaded = pickling.loads(pickling.dumps((p, frozen), _no_shared).data, lambda pid: None)
    assert isinstance(loaded[0], torch.nn.Parameter) and loaded[0].requires_grad
    assert not isinstance(loaded[1], torch.nn.Parameter) and not loaded[1].requires_grad


def test_shared_objects_travel_as_persistent_ids_and_are_bound_on_the_worker():
    shared = torch.nn.Parameter(torch.ones(3))  # a parameter that lives on the parameter servers
    worker_copy = torch.nn.Parameter(torch.full((3,), 7.0))

    def fn() -> torch.Tensor:
        return shared * 2

    payload = pickling.dumps(fn, lambda obj: ("var", "v0") if obj is shared else None)
    assert wire.decode(payload.data)["tensors"] == []  # not sent: the worker has its own copy
    loaded = pickling.loads(payload.data, lambda pid: worker_copy if pid == ("var", "v0") else None)
    assert loaded().tolist() == [14.0, 14.0, 14.0]


def test_the_digest_names_the_content():
    def fn(x: int) -> int:
        return x + 1

    a, b = pickling.dumps(fn, _no_shared), pickling.dumps(fn, _no_shared)
    assert a.digest == b.digest and len(a.digest) == 40
    assert pickling.dumps(lambda x: x + 2, _no_shared).digest != a.digest


def test_loading_refuses_what_is_not_a_wire_message():
    with pytest.raises(wire.WireError):
        pickling.loads(pickle.dumps(len), lambda pid: None)


def test_a_worker_traceback_names_the_users_file_and_source_line_with_any_cloudpickle():
    # cloudpickle >= 3.1.3 renames every pickled-by-value code object's file "<dynamic-code>";
    # pickling.py restores the real name, for the function and for the code nested in it.
    def fn(n: int) -> list:
        def helper(i: int) -> int:
            raise ValueError(f"bad input {i}")

        return [helper(i) for i in range(n)]

    loaded = pickling.loads(pickling.dumps(fn, _no_shared).data, lambda pid: None)
    assert loaded.__code__.co_filename == fn.__code__.co_filename == __file__
    with pytest.raises(ValueError) as info:
        loaded(2)
    text = "".join(traceback.format_exception(info.value))
    assert "<dynamic-code>" not in text
    helper_line = fn.__code__.co_firstlineno + 2
    assert f'File "{__file__}", line {helper_line}, in helper\n    raise ValueError(f"bad input {{i}}")' in text
    assert f'File "{__file__}", line {helper_line + 2}, in fn\n    return [helper(i) for i in range(n)]' in text
