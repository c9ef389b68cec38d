"""examples/hf_expert_parallel.py as a user runs it: `python examples/hf_expert_parallel.py`, in a fresh
interpreter with the repository on PYTHONPATH (as tests/test_readme.py runs the README's blocks). It must
exit 0 and print, for both entry points and both ranks, logits within 1e-5 of the one-process model and
the same greedy tokens, and the gathered checkpoint equal to the original.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed", reason="transformers without DistributedConfig (needs >= 5.24)")

from test_examples import run_example
from test_readme import ROOT, _in_mpi_job

EXAMPLE = ROOT / "examples" / "hf_expert_parallel.py"
RANK_LINE = re.compile(r"^  rank (\d): logits max rel diff (\S+) \| params ([\d,]+) of ([\d,]+) .*"
                       r"equal to one process: (True|False)$", re.MULTILINE)


@pytest.mark.skipif(_in_mpi_job(), reason="starts its own ranks")
def test_hf_expert_parallel_example_runs(tmp_path):
    out = run_example(EXAMPLE, tmp_path, timeout=300)
    sections = re.split(r"^\((?:a|b)\) ", out, flags=re.MULTILINE)[1:]
    assert len(sections) == 2, out
    assert sections[0].startswith("moe.hf.expert_parallel(model, comm)"), out
    assert sections[1].startswith("from_pretrained(") and 'ep_implementation="moecomm"' in sections[1], out
    assert "gather_experts_state_dict equals the original checkpoint: True" in sections[0], out
    for section in sections:
        rows = RANK_LINE.findall(section)
        assert [r[0] for r in rows] == ["0", "1"], out
        for rank, diff, held, full, same in rows:
            assert float(diff) <= 1e-5, (rank, diff, out)
            assert same == "True", (rank, out)
            assert int(held.replace(",", "")) < int(full.replace(",", "")), (rank, out)  # experts were spread
