"""Elastic expert parallelism: a decoding MoE layer loses a rank, keeps serving, and takes a newcomer in.

    python examples/elastic_moe.py                 # 4 ranks; rank 2 is killed (SIGKILL) at step 10
    python examples/elastic_moe.py --dispatch low-latency --on-peer-failure mask --redundant 4 --kill 0
    python examples/elastic_moe.py --transport gloo  # the host path over gloo instead of shared memory

What happens (every rank checks every step against a reference computed in its own process):

1. Steps 0..K-1 on all ranks. At step K the victim kills itself with SIGKILL.
2. The survivors' step K raises ``PeerFailedError`` naming it (``--on-peer-failure raise``; they then
   call ``layer.shrink(exclude=[victim])``), or the layer masks it itself (``mask``) and returns.
   Either way the next steps run on the survivors, the victim's experts served by their replicas
   (``--redundant``: EPLB) or dropped (their slots left out of each token's sum).
3. The survivors' first rank starts a newcomer (this script with ``--join``), which joins with
   ``collectives.init(join=...)``; the survivors grow their communicator and ``layer.grow`` it; the
   newcomer gets its experts from the survivors that hold replicas, else from the checkpoint
   written at the start. The last steps run on all ranks again and equal the original model.

The weights are the seed's plus a perturbation, so that a newcomer's own seeded draw is not the model:
what it serves it received.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives  # noqa: E402
from collectives import PeerFailedError  # noqa: E402
from moe import GroupedExperts, MoELayer, SharedExpert, TopKRouter, gather_state_dict  # noqa: E402
from moe.ffn import _ACTIVATIONS  # noqa: E402

log = logging.getLogger("elastic_moe")
H, F, E, K, SHARED, M, SEED = 128, 64, 8, 2, 32, 8, 7


def _layer_args(args: argparse.Namespace) -> dict:
    return {"hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "top_k": K, "shared_ffn_hidden_size": SHARED,
            "seed": SEED, "num_redundant_experts": args.redundant, "on_peer_failure": args.on_peer_failure}


def _noise(name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.05 * torch.randn(*shape, generator=g)


def _perturb(layer: MoELayer) -> None:
    """The model: the seed's weights plus noise keyed by logical expert id (replicas stay equal)."""
    with torch.no_grad():
        for i, e in enumerate(layer.experts.expert_ids):
            layer.experts.fc1[i] += _noise(f"fc1/{e}", layer.experts.fc1[i].shape)
            layer.experts.fc2[i] += _noise(f"fc2/{e}", layer.experts.fc2[i].shape)
        layer.router.weight += _noise("router", layer.router.weight.shape)


class Reference:
    """The whole model in one process: router, all E experts, shared expert (with the same perturbation)."""

    def __init__(self) -> None:
        self.router = TopKRouter(H, E, K, seed=SEED)
        self.experts = GroupedExperts(E, 0, H, F, "swiglu", SEED)
        self.shared = SharedExpert(H, SHARED, "swiglu", SEED)
        with torch.no_grad():
            for e in range(E):
                self.experts.fc1[e] += _noise(f"fc1/{e}", self.experts.fc1[e].shape)
                self.experts.fc2[e] += _noise(f"fc2/{e}", self.experts.fc2[e].shape)
            self.router.weight += _noise("router", self.router.weight.shape)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, dropped: set[int]) -> torch.Tensor:
        """y [T, H] of x [T, H] with the slots that chose an expert in ``dropped`` left out."""
        w, chosen, _ = self.router.route(x)
        act = _ACTIVATIONS["swiglu"]
        y = self.shared(x).double()
        for e in range(E):
            if e in dropped:
                continue
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out = act(x[rows] @ self.experts.fc1[e]) @ self.experts.fc2[e]
            y.index_add_(0, rows, w[rows, slot, None].double() * out.double())
        return y.float()


def _tokens(step: int, who: str) -> torch.Tensor:
    """This step's tokens of one rank (0..M of them; 0 too), the same wherever they are computed."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{step}/{who}".encode()))
    n = int(torch.randint(0, M + 1, (1,), generator=g))
    return torch.randn(n, H, generator=g)


def _step(layer: MoELayer, x: torch.Tensor, low_latency: bool) -> torch.Tensor:
    return layer.decode(x) if low_latency else layer(x)[0]


def _check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _open_fds() -> set[str]:
    """This process's descriptors, as "fd -> target"."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def _dropped(layer: MoELayer) -> set[int]:
    """Logical experts with no replica on the unmasked ranks."""
    p = layer.placement
    alive = [r for r in range(p.num_ranks) if r not in set(layer.masked_ranks)]
    held = {int(p.physical_to_logical[s]) for r in alive for s in p.slots_of(r)}
    return set(range(E)) - held


def _rank(comm: collectives.Communicator, args: argparse.Namespace) -> dict:
    ll = args.dispatch == "low-latency"
    fds, threads = _open_fds(), threading.active_count()
    ref = Reference()
    layer = MoELayer(comm, **_layer_args(args))
    _perturb(layer)
    if ll:
        layer.init_low_latency(M, dtype=torch.float32)
    full = gather_state_dict(layer)  # the "checkpoint" a newcomer may load experts from
    if comm.rank == 0:
        torch.save({k: full[k] for k in layer.expert_keys}, args.checkpoint)
    me = comm.rank
    report: dict = {"rank": me}
    for step in range(args.kill_step + args.steps):
        if step == args.kill_step and me == args.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        x = _tokens(step, f"r{me}")
        t0 = time.monotonic()
        try:
            y = _step(layer, x, ll)
        except PeerFailedError as e:
            report["detected_s"], report["named"] = time.monotonic() - t0, list(e.missing_ranks)
            t1 = time.monotonic()
            layer.shrink(exclude=[args.kill])
            report["shrink_s"] = time.monotonic() - t1
            y = _step(layer, x, ll)
        if step == args.kill_step:
            report["step_s"] = time.monotonic() - t0
        _check(y, ref(x, _dropped(layer)), f"rank {me} step {step}")
    report["masked"], report["dropped"] = list(layer.masked_ranks), sorted(_dropped(layer))
    survivors = layer.dispatcher.active_comm
    joiner = None
    if survivors.rank == 0:
        cmd = [sys.executable, os.path.abspath(__file__), "--join", survivors.join_address(),
               "--dispatch", args.dispatch, "--on-peer-failure", args.on_peer_failure,
               "--redundant", str(args.redundant), "--kill-step", str(args.kill_step), "--steps", str(args.steps),
               "--kill", str(args.kill), "--timeout", str(args.timeout)]
        if _dropped(layer) and not args.no_checkpoint:
            cmd += ["--checkpoint", args.checkpoint]
        joiner = subprocess.Popen(cmd)
    t0 = time.monotonic()
    try:
        grown = survivors.grow(1)
        layer.grow(grown)
    except BaseException:
        if joiner is not None:  # it fails too (its grow was aborted): reap it
            joiner.wait(timeout=args.timeout)
        raise
    report["grow_s"] = time.monotonic() - t0
    for step in range(args.kill_step + args.steps, args.kill_step + 2 * args.steps):
        x = _tokens(step, f"g{grown.rank}")
        _check(_step(layer, x, ll), ref(x, set()), f"rank {me} (now {grown.rank}) step {step} after the grow")
    layer.close()
    grown.close()
    comm.close()  # the first communicator too: the low-latency buffers of the first layer live in its ipc transport
    report["new_fds"] = sorted(_open_fds() - fds)
    report["threads_before"], report["threads_after"] = threads, threading.active_count()
    if joiner is not None:
        report["joiner_exit"] = joiner.wait(timeout=args.timeout)
    return report


def _join(args: argparse.Namespace) -> int:
    """The newcomer: join, receive the layer, serve the last steps with the others."""
    comm = collectives.init(join=args.join, timeout=args.timeout, device="cpu")
    weights = None
    if args.checkpoint:
        weights = torch.load(args.checkpoint)
    layer = MoELayer.join(comm, expert_weights=weights)
    ref = Reference()
    for step in range(args.kill_step + args.steps, args.kill_step + 2 * args.steps):
        x = _tokens(step, f"g{comm.rank}")
        _check(_step(layer, x, args.dispatch == "low-latency"), ref(x, set()), f"newcomer step {step}")
    layer.close()
    comm.close()
    print(f"newcomer (rank {comm.rank}): {args.steps} steps equal to the original model")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kill", type=int, default=2, help="the rank killed with SIGKILL")
    ap.add_argument("--kill-step", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="steps after the death, and again after the grow")
    ap.add_argument("--dispatch", choices=["normal", "low-latency"], default="normal")
    ap.add_argument("--on-peer-failure", choices=["raise", "mask"], default="raise")
    ap.add_argument("--transport", choices=["auto", "shm", "gloo"], default="auto",
                    help="the host path's transport (low-latency dispatch needs ipc, which auto adds)")
    ap.add_argument("--redundant", type=int, default=0, help="EPLB redundant expert slots")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--join", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="give the newcomer no checkpoint (the grow then fails when no survivor holds some expert)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.dispatch == "low-latency":
        os.environ.setdefault("MOECOMM_IPC_EMULATE", "1" if not torch.cuda.is_available() else "0")
    if args.join:
        return _join(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.checkpoint = os.path.join(tmp, "experts.pt")
        results = collectives.launch(_rank, args.ranks, args, timeout=args.timeout, return_exceptions=True,
                                     device="cpu", transport=args.transport)
    ok = True
    for r, res in enumerate(results):
        if r == args.kill:
            if not isinstance(res, collectives.RankFailedError):
                print(f"rank {r}: expected to die, got {res!r}")
                ok = False
            continue
        if isinstance(res, BaseException):
            print(f"rank {r}: FAILED: {type(res).__name__}: {res}")
            ok = False
            continue
        line = (f"rank {r}: step {args.kill_step} took {res['step_s']:.2f} s"
                + (f" (PeerFailedError naming {res['named']} after {res['detected_s']:.2f} s, shrink "
                   f"{res['shrink_s']:.2f} s)" if "named" in res else " (masked)")
                + f"; masked {res['masked']}, dropped experts {res['dropped']}; grow {res['grow_s']:.2f} s; "
                f"descriptors left open: {res['new_fds']}, threads {res['threads_before']} -> "
                f"{res['threads_after']}")
        print(line)
        ok &= res.get("joiner_exit", 0) == 0
    print("elastic decode: ok" if ok else "elastic decode: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
