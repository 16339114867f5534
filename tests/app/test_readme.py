"""The README is the package's long description: it starts with the repository's two set-up commands on
lines of their own (as .ci/run calls the test one), and its quickstart runs as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_quickstart_runs_as_printed(tmp_path):
    quickstart = README.index("## Quickstart")
    assert quickstart < README.index("## Working on this repository")
    code = re.search(r"```python\n(.*?)```", README[quickstart:], re.DOTALL).group(1)
    (tmp_path / "quickstart.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "quickstart.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "TF_CONFIG": "", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    epochs = re.findall(r"^Epoch (\d), Loss: (\d\.\d{4}), Accuracy: (\d+\.\d\d)$", result.stdout, re.MULTILINE)
    assert [e[0] for e in epochs] == ["1", "2", "3"], result.stdout
    assert float(epochs[2][1]) < float(epochs[0][1]) and float(epochs[2][2]) > 85.0  # it learns


def test_the_readme_starts_with_the_two_set_up_commands():
    first_block = re.search(r"^```(\w*)\n(.*?)```$", README, re.MULTILINE | re.DOTALL)
    assert first_block and first_block.groups() == ("bash", "bash scripts/train.sh\nbash scripts/test.sh\n")
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "torch 2.13.0" in README and "torch>=2.4" in README  # the tested version, said beside the declared range
