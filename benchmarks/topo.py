"""``moecomm topo``: this node's GPUs, NICs and how they connect, like ``nvidia-smi topo -m`` plus the NICs."""

from __future__ import annotations

import json
import os
import sys

import click


@click.command("topo")
@click.option("--json", "as_json", is_flag=True, help="Print the topology as JSON instead of tables.")
@click.option("--probe/--no-probe", default=True, show_default=True,
              help="Try P2P between every pair of visible CUDA devices (torch.cuda; needs 2+ GPUs).")
@click.option("--copy/--no-copy", default=True, show_default=True,
              help="With --probe: also do a checked 1 MiB peer copy per pair, not only ask CUDA.")
@click.option("--nvml/--no-nvml", default=True, show_default=True, help="Ask NVML (pynvml) when installed.")
@click.option("--cross-check", is_flag=True,
              help="Also run `nvidia-smi topo -m` and list where it disagrees (exit 1 if it does).")
@click.option("--from", "recording", type=click.Path(exists=True, file_okay=False),
              help="Show a recording (a directory written by --record, or a test fixture) instead of this node.")
@click.option("--record", "record_dir", type=click.Path(file_okay=False),
              help="Write what topo reads on this node (sysfs files, NVML, nvidia-smi) into this directory.")
def topo(as_json: bool, probe: bool, copy: bool, nvml: bool, cross_check: bool, recording: str | None,
         record_dir: str | None) -> None:
    """GPUs (PCI bus id, NUMA node, NVLinks, P2P), NICs (InfiniBand/RoCE/Ethernet, link rate) and the
    connection matrix between them (X, NV#, PIX, PXB, PHB, NODE, SYS as nvidia-smi writes them).

    Exit status: 0, or 1 when --cross-check found differences or could not run, or 2 for a usage error
    (a --record directory that cannot be written, a --from directory that holds no recording).
    """
    from collectives import topology as gt
    from collectives.topology.render import render

    if record_dir:
        try:
            files = gt.record(record_dir, nvml=nvml)
        except OSError as e:
            raise click.BadParameter(f"cannot write a recording into {record_dir!r}: {e.strerror or e}",
                                     param_hint="'--record'") from None
        click.echo(f"recorded {len(files)} file(s) into {record_dir}", err=True)
    if recording:
        try:
            t = gt.load_recording(recording)
        except FileNotFoundError as e:
            raise click.BadParameter(str(e), param_hint="'--from'") from None
    else:
        t = gt.detect(use_nvml=nvml, probe=False)
        if probe and t.gpus:
            t = gt.probe_p2p(t, copy=copy)
    problems: list[str] = []
    why = None
    if cross_check:
        if recording:
            path = os.path.join(recording, gt.RECORD_FILES["smi_topo"])
            text, why = None, f"no {path}"
            if os.path.exists(path):
                with open(path) as f:
                    text, why = f.read(), None
        else:
            text, why = gt.run_nvidia_smi("topo", "-m")
        problems = gt.cross_check(t, text) if text else []
    if as_json:
        d = t.to_dict()
        if cross_check:
            d["cross_check"] = {"done": why is None, "why_not": why, "differences": problems}
        click.echo(json.dumps(d, indent=1))
    else:
        click.echo(render(t))
        if cross_check:
            verdict = f"not done: {why}" if why else "differs" if problems else "agrees"
            click.echo(f"\nCross-check with nvidia-smi topo -m: {verdict}")
            for p in problems:
                click.echo(f"  - {p}")
    if problems or why:  # asked to check and could not, or it disagreed
        sys.exit(1)
