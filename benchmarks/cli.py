"""The ``moecomm`` command line."""

from __future__ import annotations

import logging

import click

from .ranks import configure_logging, set_cli_log_level


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="-v: INFO logs, -vv: DEBUG (one line per transport decision).")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """moecomm: collective communication and MoE all-to-all benchmarks and tools."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    configure_logging(level)
    set_cli_log_level(ctx, level)  # self-launched ranks log at this level too


# `moecomm bench` / `report` / `doctor` (benchmarks/bench.py, report.py, doctor.py)
from .bench import bench  # noqa: E402
from .doctor import doctor  # noqa: E402
from .report import report  # noqa: E402

main.add_command(bench)
main.add_command(report)
main.add_command(doctor)


# Commands that live in their own modules.
from .bench_ddp import bench_ddp  # noqa: E402
from .bench_hf import bench_hf  # noqa: E402
from .bench_moe import bench_moe  # noqa: E402
from .bench_p2p import bench_p2p
from .bench_tp import bench_tp  # noqa: E402
from .gpu_validate import validate_gpu  # noqa: E402
from .paths_cli import paths  # noqa: E402
from .predict import predict  # noqa: E402
from .testbed_cli import testbed  # noqa: E402
from .topo import topo  # noqa: E402

main.add_command(bench_ddp)
main.add_command(bench_hf)
main.add_command(bench_moe)
main.add_command(bench_p2p)
main.add_command(bench_tp)
main.add_command(testbed)
main.add_command(topo)
main.add_command(paths)
main.add_command(validate_gpu)
main.add_command(predict)

if __name__ == "__main__":
    main()
