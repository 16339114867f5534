"""The GPU check's correctness cases (``function_cases.py``) on the CPU stand-in for CUDA graphs: every feature
(accumulation, clipping, a schedule, autocast, a GradScaler, a checkpoint restored mid-run) captured and replayed
trains exactly as the same run without ``ds.function``, with the guards of ``ds.function`` in the path."""

from __future__ import annotations

import pytest
import torch
from function_cases import FEATURES, largest_difference, run_case

STEPS = 15  # 2 warm-up calls, a capture, replays; the checkpoint saved at step 5 and restored at step 8


@pytest.mark.parametrize("feature", FEATURES)
def test_each_case_replays_as_eager_on_the_stand_in(stand_in, feature):
    cpu = torch.device("cpu")
    eager = run_case(cpu, "default", feature, use_function=False, steps=STEPS, capturable=feature != "fp16")
    graphed = run_case(cpu, "default", feature, use_function=True, steps=STEPS)
    diff = largest_difference(graphed, eager)
    # a float rate written by hand is kept as float32 in the capturable optimizer's tensor (as on a GPU)
    assert max(diff.values()) <= (1e-6 if feature == "schedule" else 0.0), (diff, graphed["paths"])
    full_batch = graphed["paths"][next(iter(graphed["paths"]))]
    if feature == "fp16":  # GradScaler.step reads its inf check on the host with an optimizer that is not fused
        assert full_batch.startswith("eager: the step reads a tensor's value on the host"), graphed["paths"]
    else:
        assert full_batch.startswith("cuda_graph"), graphed["paths"]
