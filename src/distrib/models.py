"""The tutorials' Fashion-MNIST CNN (provisional plain formulation)."""

from __future__ import annotations

import torch
from torch import nn


def _keras_init(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    return model


def plain_fashion_mnist_cnn() -> nn.Module:
    return _keras_init(nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10)))


fashion_mnist_cnn = plain_fashion_mnist_cnn


def maybe_compile(model: nn.Module, enabled: bool) -> nn.Module:
    return torch.compile(model) if enabled else model
