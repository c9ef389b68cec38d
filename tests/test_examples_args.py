"""The examples take no options (issue #51 point 17): ``--help`` prints the example's docstring and exits 0,
anything else is a usage error (exit code 2); neither starts a rank. Run in this process as
``python examples/X.py ARGS`` would run them (``runpy`` as ``__main__``), with ``collectives.launch``
replaced by one that fails the test, so a regression cannot start ranks.
"""

from __future__ import annotations

import runpy
import sys

import pytest
from test_readme import ROOT

import collectives

EXAMPLES = ["quickstart.py", "hf_expert_parallel.py", "train_moe.py"]


def _run(monkeypatch, name: str, *args: str) -> int:
    def no_launch(*a, **k):
        raise AssertionError(f"{name} {' '.join(args)} started ranks")

    monkeypatch.setattr(collectives, "launch", no_launch)
    path = str(ROOT / "examples" / name)
    monkeypatch.setattr(sys, "argv", [path, *args])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(path, run_name="__main__")
    return info.value.code


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_help_and_unknown_arguments(name, monkeypatch, capsys):
    assert _run(monkeypatch, name, "--help") == 0
    out = capsys.readouterr().out
    first = (ROOT / "examples" / name).read_text().split('"""')[1].splitlines()[0]
    assert first in out, out  # its docstring, the example's description
    assert _run(monkeypatch, name, "--ranks", "8") == 2
    assert "unrecognized arguments: --ranks 8" in capsys.readouterr().err
