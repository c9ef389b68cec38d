"""Run PyTorch's own distributed suite (``DistributedTest``) over a torch.distributed backend.

    python tools/torch_dist_suite.py --backend gloo -n 2 --json gloo2.json     # the reference
    python tools/torch_dist_suite.py --backend moecomm -n 2 --only gloo2.json   # the tests gloo passes
    python tools/torch_dist_suite.py -n 3 --only tools/torch_dist_suite_gloo2.txt --lift
    python tools/torch_dist_suite.py -n 4 --lift -k gather_object              # a few tests

tools/torch_dist_suite_gloo2.txt lists the tests that pass over gloo at 2 ranks on torch 2.13
(91 of 285). On 2 shared cores with forked ranks: gloo over all 285 tests about 2 minutes (194
skip at once), moecomm over gloo's 91 about 1 minute at 2 ranks and 1 to 2 at 3 ranks.

This is what PyTorch's ``test/distributed/test_distributed_spawn.py`` does (and ``run_test.py``
for it): ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` and ``INIT_METHOD`` (file://) in the
environment, then ``TestDistBackend`` + ``DistributedTest._DistTestBase`` run one test at a time,
each in ``WORLD_SIZE`` spawned processes that call ``init_process_group(BACKEND)``.

The module gates many tests on the backend's name, when it is imported (``BACKEND != "gloo"``
skips) and inside test bodies (``if BACKEND == "gloo":`` builds the model). ``--lift`` imports it
as if the backend were gloo (the decorators read "gloo"), then sets its ``BACKEND`` to the
backend's name as a string that also equals "gloo" (the bodies take gloo's branches; the groups
are the backend's), so those tests run too. Checks made by torch itself on the group's real
backend stay (``monitored_barrier`` is gloo's only).

Spawned processes import this file again: everything the ranks need is set up at import, from
the environment (``MOECOMM_SUITE_BACKEND``, ``MOECOMM_SUITE_LIFT``), which ``main`` sets.

Output: one line per test (PASS / FAIL / ERROR / SKIP, seconds), a summary, and with ``--json``
``{"backend", "world_size", "lift", "torch", "seconds", "results": {test: outcome}}``. With
``--only FILE`` (such a JSON, or a text file of test names) only the tests that passed there
(or are listed) run. Exit status 0 when no test ran into FAIL/ERROR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_BACKEND = os.environ.get("MOECOMM_SUITE_BACKEND", "")
_LIFT = os.environ.get("MOECOMM_SUITE_LIFT") == "1"

if _BACKEND:  # the parent after main() set the environment, and every spawned rank
    os.environ["BACKEND"] = "gloo" if _LIFT else _BACKEND
    from torch.testing._internal.distributed import distributed_test as _dt

    import collectives  # noqa: F401 - registers the "moecomm" backend (in every rank)

    class _AsGloo(str):
        """The backend's name, which also equals "gloo": test bodies that branch on ``BACKEND == "gloo"``
        take gloo's branch, while ``init_process_group(backend=BACKEND)`` gets the backend itself."""

        def __eq__(self, other):
            return str.__eq__(self, other) or other == "gloo"

        def __ne__(self, other):
            return not self.__eq__(other)

        __hash__ = str.__hash__

    if _LIFT:
        _dt.BACKEND = _AsGloo(_BACKEND)  # the decorators, evaluated at import, already read "gloo"
        os.environ["BACKEND"] = _BACKEND

    class TestDistBackendWithSpawn(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
        """One test in WORLD_SIZE processes, forked (as PyTorch's former test_distributed_fork.py: seconds
        faster per test) or spawned (as test_distributed_spawn.py)."""

        def setUp(self):
            super().setUp()
            if os.environ.get("MOECOMM_SUITE_START") == "spawn":
                self._spawn_processes()
            else:
                import torch.multiprocessing as tmp

                self._start_processes(tmp.get_context("fork").Process)


def _names_from(path: str) -> set[str]:
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        return {t for t, outcome in json.loads(text)["results"].items() if outcome == "PASS"}
    return {line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")}


class _Result(unittest.TextTestResult):
    """Records one outcome per test: PASS, FAIL, ERROR or SKIP (with the time it took)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        self.details: dict[str, str] = {}
        self._t0 = 0.0

    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, detail=""):
        name = test.id().split(".")[-1]
        self.outcomes[name] = outcome
        if detail:
            self.details[name] = detail
        self.stream.write(f"{outcome:5s} {time.monotonic() - self._t0:6.1f}s {name}\n")
        self.stream.flush()

    def addSuccess(self, test):
        self._record(test, "PASS")

    def addFailure(self, test, err):
        unittest.TestResult.addFailure(self, test, err)
        self._record(test, "FAIL", self.failures[-1][1])

    def addError(self, test, err):
        unittest.TestResult.addError(self, test, err)
        self._record(test, "ERROR", self.errors[-1][1])

    def addSkip(self, test, reason):
        unittest.TestResult.addSkip(self, test, reason)
        self._record(test, "SKIP", reason)

    def addExpectedFailure(self, test, err):
        self._record(test, "PASS")

    def addUnexpectedSuccess(self, test):
        self._record(test, "FAIL", "unexpected success")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="moecomm")
    p.add_argument("-n", "--world-size", type=int, default=2)
    p.add_argument("--lift", action="store_true", help="import the suite as if the backend were gloo")
    p.add_argument("-k", action="append", default=[], help="run tests whose name contains this (repeatable)")
    p.add_argument("--only", help="a --json result (its PASS tests) or a file of test names")
    p.add_argument("--json", help="write the outcomes here")
    p.add_argument("--test-timeout", type=int, default=180, help="seconds per test (PyTorch's default is 300)")
    p.add_argument("--start", choices=["fork", "spawn"], default="fork",
                   help="how ranks start: fork (fast) or spawn (as test_distributed_spawn.py)")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    args = p.parse_args(argv)

    try:
        import expecttest  # noqa: F401 - torch's testing modules import it
    except ImportError:
        sys.exit("torch_dist_suite: PyTorch's test modules need expecttest: pip install expecttest")
    if not _BACKEND:  # set the environment, then run again: the module gates read it when imported
        tmp = tempfile.mkdtemp(prefix="torch_dist_suite_")
        os.environ.update({"MOECOMM_SUITE_BACKEND": args.backend, "MOECOMM_SUITE_LIFT": "1" if args.lift else "0",
                           "WORLD_SIZE": str(args.world_size), "TEMP_DIR": tmp,
                           "INIT_METHOD": f"file://{tmp}/shared_init_file",
                           "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.test_timeout),
                           "MOECOMM_SUITE_START": args.start})
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()),
                 *(argv if argv is not None else sys.argv[1:])])
    sys.argv = sys.argv[:1]  # common_utils parses sys.argv
    cls = TestDistBackendWithSpawn

    names = sorted(n for n in unittest.TestLoader().getTestCaseNames(cls))
    if args.only:
        keep = _names_from(args.only)
        names = [n for n in names if n in keep]
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(stream=sys.stdout, resultclass=_Result, verbosity=0)
    t0 = time.monotonic()
    result = runner.run(suite)
    seconds = time.monotonic() - t0
    counts: dict[str, int] = {}
    for outcome in result.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    import torch

    mode = " (name checks lifted)" if args.lift else ""
    print(f"{args.backend}{mode} at {args.world_size} ranks, torch {torch.__version__}: {len(names)} tests, "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" in {seconds:.0f} s")
    bad = sorted(n for n, o in result.outcomes.items() if o in ("FAIL", "ERROR"))
    if bad:
        print("failed: " + " ".join(bad))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "backend": args.backend, "world_size": args.world_size, "lift": args.lift, "torch": torch.__version__,
            "seconds": round(seconds, 1), "results": result.outcomes,
            "details": {n: d[-3000:] for n, d in result.details.items() if result.outcomes[n] != "SKIP"},
        }, indent=1, sort_keys=True))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
