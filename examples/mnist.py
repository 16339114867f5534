"""pytorch/examples' ``mnist/main.py`` ported to distrib: same network, optimizer, schedule and logs.

The original trains one process on one device. This port runs unchanged on one device, on
several local replicas (``--replicas 2``), or on several worker processes
(``distrib launch --workers 2 examples/mnist.py`` or ``torchrun --nproc-per-node 2 examples/mnist.py``).
What changed, each point explained in docs/coming-from-ddp.md:

1. A strategy is chosen once (``make_strategy``); the model and optimizer are built in its scope.
2. ``--batch-size`` is the *global* batch, as in the original's one process: N replicas get
   ``batch_size / N`` each, so the same flags train the same model on 1 or N replicas.
3. The loss is per example, summed and divided by the global batch (``ds.compute_average_loss``),
   because distrib *sums* gradients over replicas (a mean-reduced loss is refused).
4. The step runs in ``strategy.run`` over ``strategy.experimental_distribute_dataset(loader)``;
   every worker reads the same global batches (the loader's shuffle is seeded) and takes its slice.
5. Logs and the saved model come from the chief only (``strategy.is_chief``).
6. Test: each replica sums its loss and correct count; ``strategy.reduce(SUM)`` adds them up.

Data: the IDX files of MNIST (``--data-dir``) or, by default, Debian's Fashion-MNIST (same format);
the original downloads MNIST with torchvision, which distrib does not need.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

import distrib as ds
from distrib.app.datasets import load_fashion_mnist


class Net(nn.Module):
    """The example's CNN: two convolutions, max-pooling, dropout, two dense layers, log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


def train(args, strategy, model, train_loader, optimizer, epoch):
    model.train()

    def step(data, target):
        loss = ds.compute_average_loss(F.nll_loss(model(data), target, reduction="none"))  # (3)
        loss.backward()
        optimizer.step()  # sums the replicas' gradients, then one identical update everywhere
        optimizer.zero_grad()
        return loss

    for batch_idx, (data, target) in enumerate(strategy.experimental_distribute_dataset(train_loader)):  # (4)
        loss = strategy.reduce("sum", strategy.run(step, args=(data, target)), axis=None)
        if batch_idx % args.log_interval == 0:
            if strategy.is_chief:  # (5)
                print(
                    f"Train Epoch: {epoch} [{batch_idx * args.batch_size}/{len(train_loader.dataset)} ({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )
            if args.dry_run:
                break


def test(strategy, model, test_loader):
    model.eval()

    def step(data, target):  # (6) sums per replica; reduce adds the replicas and workers
        output = model(data)
        return F.nll_loss(output, target, reduction="sum"), output.argmax(dim=1).eq(target).sum()

    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in strategy.experimental_distribute_dataset(test_loader):
            loss, right = strategy.run(step, args=(data, target))
            test_loss += strategy.reduce("sum", loss, axis=None).item()
            correct += int(strategy.reduce("sum", right, axis=None).item())
    test_loss /= len(test_loader.dataset)
    if strategy.is_chief:
        print(
            f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} ({100.0 * correct / len(test_loader.dataset):.0f}%)\n"
        )
    return test_loss, correct


def make_strategy(replicas):
    """(1) Several workers when a launcher started this process, else the local devices."""
    if "TF_CONFIG" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:
        return ds.MultiWorkerMirroredStrategy()
    return ds.MirroredStrategy(None if replicas is None else [f"cpu:{i}" for i in range(replicas)])


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="PyTorch MNIST Example, on distrib", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="global batch for training (2)")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="global batch for testing")
    parser.add_argument("--epochs", type=int, default=14, metavar="N", help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR", help="learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M", help="learning rate step gamma")
    parser.add_argument("--replicas", type=int, default=None, help="local replicas (default: every GPU, or the CPU)")
    parser.add_argument("--dry-run", action="store_true", help="quickly check a single pass")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed")
    parser.add_argument(
        "--log-interval",
        type=int,
        default=10,
        metavar="N",
        help="how many batches to wait before logging training status",
    )
    parser.add_argument("--save-model", action="store_true", help="save the trained model to mnist_cnn.pt")
    parser.add_argument("--data-dir", default=None, help="directory of the four IDX files")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    strategy = make_strategy(args.replicas)
    if strategy.is_chief:
        print(f"Replicas in sync: {strategy.num_replicas_in_sync}\n")

    (train_x, train_y), (test_x, test_y) = load_fashion_mnist(args.data_dir)
    normalize = lambda x: (x - 0.1307) / 0.3081  # noqa: E731  transforms.Normalize((0.1307,), (0.3081,))
    dataset1, dataset2 = TensorDataset(normalize(train_x), train_y), TensorDataset(normalize(test_x), test_y)
    shuffle_seed = torch.Generator().manual_seed(args.seed)  # (4) the same global batches on every worker
    train_loader = DataLoader(dataset1, batch_size=args.batch_size, shuffle=True, generator=shuffle_seed)
    test_loader = DataLoader(dataset2, batch_size=args.test_batch_size)

    with strategy.scope():  # (1)
        model = Net()
        optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    for epoch in range(1, args.epochs + 1):
        train(args, strategy, model, train_loader, optimizer, epoch)
        test(strategy, model, test_loader)
        scheduler.step()

    if args.save_model and strategy.is_chief:  # (5)
        torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == "__main__":
    main()
