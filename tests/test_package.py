"""The package as a whole: what `import distrib` loads, its import graph, and what it leaves on user objects."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distrib as ds

ROOT = Path(__file__).resolve().parents[1]
CYCLES_TOOL = ROOT.parent / "shared" / "tools" / "import_cycles.py"


def test_import_distrib_loads_no_parameter_server_dependency():
    code = "import distrib, sys; print(sorted({'grpc', 'cloudpickle'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import distrib as ds, sys; ds.ParameterServerStrategy; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"  # loaded on first use


def test_import_distrib_and_distrib_launch_load_no_torch(tmp_path):
    """`import distrib` loads each name on first use, so `distrib launch` (a process that only starts and watches
    its tasks, which import torch themselves) starts without torch: about 0.1 s instead of 1.5 s on every launch."""
    script = tmp_path / "task.py"
    script.write_text("import os; print('task', os.environ['TF_CONFIG'] != '')\n")
    code = (
        "import sys\nfrom distrib.app.cli import main\n"
        f"code = main(['launch', '--workers', '2', {str(script)!r}])\n"
        "print('exit', code, sorted({'torch', 'grpc', 'cloudpickle'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.count("task True") == 2 and "exit 0 []" in out, out
    code = "import distrib as ds, sys; ds.MirroredStrategy; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"  # loaded on first use


NO_NUMPY = """
import sys
class NoNumpy:  # as in an environment without numpy
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoNumpy())
"""


def test_distrib_runs_without_numpy_and_torch_s_numpy_warning_is_not_shown():
    code = NO_NUMPY + (
        "import distrib as ds, torch\n"
        "s = ds.MirroredStrategy(['cpu:0', 'cpu:1'])\n"
        "print(s.reduce('sum', s.run(lambda: torch.ones(2)), axis=None).tolist(), 'numpy' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[2.0,", "2.0]", "False"]
    # the filter is what keeps it quiet: torch alone warns
    torch_alone = subprocess.run([sys.executable, "-c", NO_NUMPY + "import torch"], capture_output=True, text=True)
    assert "Failed to initialize NumPy" in torch_alone.stderr


@pytest.mark.skipif(not CYCLES_TOOL.is_file(), reason="the shared import-cycle tool is not beside this checkout")
def test_no_runtime_import_cycle_inside_the_package():
    result = subprocess.run(
        [sys.executable, str(CYCLES_TOOL), str(ROOT / "src"), "distrib"], capture_output=True, text=True
    )
    assert '"cycles": []' in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("make", [lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]), lambda: ds.OneDeviceStrategy("cpu")])
def test_distributing_sets_no_attribute_on_the_user_s_objects(make):
    strategy = make()
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for mine, theirs in zip(model.modules(), plain.modules()):
        # `forward` is the one documented change (replica dispatch, with several local replicas)
        assert set(vars(mine)) - {"forward"} == set(vars(theirs))
    assert set(vars(optimizer)) - {"step", "zero_grad"} == set(vars(plain_optimizer))
    assert ds.context.owner_of(model) is strategy and ds.context.owner_of(optimizer) is strategy


def test_every_strategy_has_a_public_topology():
    for strategy in (
        ds.get_strategy(),
        ds.OneDeviceStrategy("cpu"),
        ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        ds.MultiWorkerMirroredStrategy(devices=["cpu:0"]),
    ):
        assert (strategy.worker_index, strategy.num_workers, strategy.is_chief) == (0, 1, True)
        assert strategy.num_local_replicas * strategy.num_workers == strategy.num_replicas_in_sync
        assert len(strategy.local_devices) == strategy.num_local_replicas
        strategy.barrier()


def test_parameter_servers_without_their_extra_name_the_install_command():
    code = """
import builtins
real = builtins.__import__
def without_grpc(name, *args, **kwargs):
    if name.split(".")[0] == "grpc":
        raise ModuleNotFoundError("No module named 'grpc'", name="grpc")
    return real(name, *args, **kwargs)
builtins.__import__ = without_grpc
import distrib as ds
ds.MirroredStrategy(["cpu:0", "cpu:1"])  # everything else works without the extra
try:
    ds.ParameterServerStrategy
except ImportError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'distrib[ps]'" in out


def _third_party_imports(package: Path) -> dict[str, str]:
    """Every absolute import of a non-stdlib, non-distrib module in ``package``: module -> first file:line."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in sys.stdlib_module_names | {"distrib"}:
                    found.setdefault(name, f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_mypy_s_result_does_not_depend_on_which_optional_packages_are_installed():
    # An optional package imported without an ignore_missing_imports override makes `python -m mypy` fail
    # wherever that extra is not installed ("Cannot find implementation or library stub"), as cryptography did.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    base = {
        re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("-", "_")
        for req in config["project"]["dependencies"]
    }
    patterns = [p for o in config["tool"]["mypy"]["overrides"] if o.get("ignore_missing_imports") for p in o["module"]]

    def covered(module: str) -> bool:  # mypy's "a.*" matches a and its submodules
        return module.split(".")[0] in base or any(
            module == p or (p.endswith(".*") and (module == p[:-2] or module.startswith(p[:-1]))) for p in patterns
        )

    imports = _third_party_imports(root / "src" / "distrib")
    assert {"torch", "cloudpickle", "grpc", "cryptography"} <= {m.split(".")[0] for m in imports}  # the walk works
    missing = {m: where for m, where in imports.items() if not covered(m)}
    assert not missing, f"add these to [[tool.mypy.overrides]] ignore_missing_imports in pyproject.toml: {missing}"
