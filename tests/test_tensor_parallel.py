"""Tensor-parallel layers vs their dense torch.nn counterparts, on 1-4 local ranks.

Every check runs inside a launched body (one launch per test and TP size, many cases per launch)
and asserts there, so a failure names the rank, the case and the numbers. Data are random
float64; the dense reference is the same computation unsharded, so the tolerances only cover
summation order.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import collectives
from collectives import tensor_parallel as tp
from spmd import run_checks

F64 = torch.float64
S, B, H, FFN, V = 12, 2, 12, 24, 36  # sequence, batch, hidden, ffn, vocab: all divisible by 1, 2, 3, 4
TP_SIZES = [1, 2, 3, 4]


# ---- helpers (run on every rank) ------------------------------------------------------------------
def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _dense_linear(i: int, o: int, seed: int, bias: bool = True, dtype=F64) -> nn.Linear:
    lin = nn.Linear(i, o, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(_rand(seed, o, i))
        if bias:
            lin.bias.copy_(_rand(seed + 1, o))
    return lin


def _dense_embedding(seed: int, dtype=F64) -> nn.Embedding:
    emb = nn.Embedding(V, H, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(_rand(seed, V, H))
    return emb


def _ids(seed: int, *shape: int) -> torch.Tensor:
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    ids.view(-1)[:3] = torch.tensor([0, V - 1, V // 2])  # both ends of the vocabulary and a shard boundary
    return ids


def _blk(t: torch.Tensor, dim: int, comm) -> torch.Tensor:
    """This rank's block of ``t`` along ``dim``."""
    return t.chunk(comm.size, dim=dim)[comm.rank]


def _gather_rows(t: torch.Tensor, comm) -> torch.Tensor:
    return comm.all_gather(t.contiguous())


def _gather_cols(t: torch.Tensor, comm) -> torch.Tensor:
    return torch.cat(comm.all_gather(t.contiguous().unsqueeze(0)).unbind(0), dim=-1)


def _close(actual, expected, what: str, comm, rtol=1e-10, atol=1e-11) -> None:
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as e:
        raise AssertionError(f"tp={comm.size} rank {comm.rank}: {what}: {e}") from None


def _raises(exc, fn, *match: str) -> str:
    try:
        fn()
    except exc as e:
        msg = str(e)
        missing = [m for m in match if m not in msg]
        assert not missing, f"{exc.__name__} message {msg!r} lacks {missing}"
        return msg
    raise AssertionError(f"expected {exc.__name__}, nothing raised")


# ---- bodies ---------------------------------------------------------------------------------------
def _regions_body(comm) -> None:
    """Each region function's forward and backward against its definition, with rank-distinct data."""
    n, r = comm.size, comm.rank
    xs = [_rand(10 + q, S, B, H) for q in range(n)]  # rank q's input; every rank can rebuild all of them
    gs = [_rand(50 + q, S, B, H) for q in range(n)]  # rank q's upstream gradient

    def run(fn, x, g):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(g)
        return y.detach(), x.grad

    y, gx = run(lambda x: tp.copy_to_tensor_parallel_region(x, comm), xs[0], gs[r])
    _close(y, xs[0], "copy_to forward", comm)
    _close(gx, sum(gs), "copy_to backward = all-reduce", comm)

    y, gx = run(lambda x: tp.reduce_from_tensor_parallel_region(x, comm), xs[r], gs[0])
    _close(y, sum(xs), "reduce_from forward = all-reduce", comm)
    _close(gx, gs[0], "reduce_from backward = identity", comm)

    y, gx = run(lambda x: tp.scatter_to_tensor_parallel_region(x, comm), xs[0], _blk(gs[r], -1, comm))
    _close(y, _blk(xs[0], -1, comm), "scatter_to forward", comm)
    _close(gx, torch.cat([gs[q].chunk(n, -1)[q] for q in range(n)], -1), "scatter_to backward = all-gather last dim",
           comm)

    y, gx = run(lambda x: tp.gather_from_tensor_parallel_region(x, comm), xs[r][..., :3], gs[0][..., :3 * n])
    _close(y, torch.cat([xs[q][..., :3] for q in range(n)], -1), "gather_from forward", comm)
    _close(gx, gs[0][..., 3 * r:3 * (r + 1)], "gather_from backward = split", comm)

    y, gx = run(lambda x: tp.scatter_to_sequence_parallel_region(x, comm), xs[0], _blk(gs[r], 0, comm))
    _close(y, _blk(xs[0], 0, comm), "scatter_to_sequence forward", comm)
    _close(gx, torch.cat([gs[q].chunk(n, 0)[q] for q in range(n)]), "scatter_to_sequence backward", comm)

    y, gx = run(lambda x: tp.gather_from_sequence_parallel_region(x, comm), xs[r][:3], gs[r][:3 * n])
    _close(y, torch.cat([xs[q][:3] for q in range(n)]), "gather_from_sequence forward", comm)
    _close(gx, sum(g[:3 * n] for g in gs)[3 * r:3 * (r + 1)], "gather_from_sequence backward = reduce-scatter",
           comm)
    y, gx = run(lambda x: tp.gather_from_sequence_parallel_region(x, comm, tensor_parallel_output_grad=False),
                xs[r][:3], gs[0][:3 * n])
    _close(gx, gs[0][3 * r:3 * (r + 1)], "gather_from_sequence(tensor_parallel_output_grad=False) backward", comm)

    y, gx = run(lambda x: tp.reduce_scatter_to_sequence_parallel_region(x, comm), xs[r], _blk(gs[r], 0, comm))
    _close(y, _blk(sum(xs), 0, comm), "reduce_scatter_to_sequence forward", comm)
    _close(gx, torch.cat([gs[q].chunk(n, 0)[q] for q in range(n)]), "reduce_scatter_to_sequence backward", comm)

    # Collectives run on detached tensors, so a second derivative would be silently wrong: it must raise.
    x = xs[0].clone().requires_grad_()
    (gx,) = torch.autograd.grad((tp.reduce_from_tensor_parallel_region(x, comm) ** 2).sum(), x, create_graph=True)
    _raises(RuntimeError, lambda: gx.sum().backward(), "once_differentiable")


def _layers_body(comm) -> None:
    """Column / row / embedding layers built with from_dense vs the dense layer: forward, input grad, param grads."""
    n = comm.size
    seed = 0
    for bias in (True, False):
        for gather_output, sp in ((False, False), (True, False), (False, True)):
            seed += 10
            case = f"column bias={bias} gather_output={gather_output} sequence_parallel={sp}"
            dense = _dense_linear(H, FFN, seed, bias)
            layer = tp.ColumnParallelLinear.from_dense(dense, comm, gather_output=gather_output, sequence_parallel=sp)
            assert layer.weight.shape == (FFN // n, H), case
            X, G = _rand(seed + 2, S, B, H), _rand(seed + 3, S, B, FFN)
            xd = X.clone().requires_grad_()
            yd = dense(xd)
            (yd * G).sum().backward()
            x = (_blk(X, 0, comm) if sp else X).clone().requires_grad_()
            y = layer(x)
            (y * (G if gather_output else _blk(G, -1, comm))).sum().backward()
            _close(y, yd.detach() if gather_output else _blk(yd.detach(), -1, comm), f"{case}: forward", comm)
            _close(x.grad, _blk(xd.grad, 0, comm) if sp else xd.grad, f"{case}: input grad", comm)
            _close(_gather_rows(layer.weight.grad, comm), dense.weight.grad, f"{case}: weight grad", comm)
            if bias:
                _close(_gather_rows(layer.bias.grad, comm), dense.bias.grad, f"{case}: bias grad", comm)

    for bias in (True, False):
        for input_is_parallel, sp in ((True, False), (False, False), (True, True)):
            seed += 10
            case = f"row bias={bias} input_is_parallel={input_is_parallel} sequence_parallel={sp}"
            dense = _dense_linear(FFN, H, seed, bias)
            layer = tp.RowParallelLinear.from_dense(dense, comm, input_is_parallel=input_is_parallel,
                                                    sequence_parallel=sp)
            assert layer.weight.shape == (H, FFN // n), case
            X, G = _rand(seed + 2, S, B, FFN), _rand(seed + 3, S, B, H)
            xd = X.clone().requires_grad_()
            yd = dense(xd)
            (yd * G).sum().backward()
            x = (_blk(X, -1, comm) if input_is_parallel else X).clone().requires_grad_()
            y = layer(x)
            # Under sequence parallelism each rank's loss covers its rows; their sum is the dense loss.
            (y * (_blk(G, 0, comm) if sp else G)).sum().backward()
            _close(y, _blk(yd.detach(), 0, comm) if sp else yd.detach(), f"{case}: forward", comm)
            _close(x.grad, _blk(xd.grad, -1, comm) if input_is_parallel else xd.grad, f"{case}: input grad", comm)
            _close(_gather_cols(layer.weight.grad, comm), dense.weight.grad, f"{case}: weight grad", comm)
            if bias:
                _close(layer.bias.grad, dense.bias.grad, f"{case}: bias grad (reduced by the layer)", comm)

    for sp in (False, True):
        for id_dtype in (torch.int64, torch.int32):
            seed += 10
            case = f"embedding sequence_parallel={sp} ids {id_dtype}"
            dense = _dense_embedding(seed)
            layer = tp.VocabParallelEmbedding.from_dense(dense, comm, sequence_parallel=sp)
            assert layer.weight.shape == (V // n, H), case
            ids, G = _ids(seed + 2, S, B), _rand(seed + 3, S, B, H)
            yd = dense(ids)
            (yd * G).sum().backward()
            y = layer(ids.to(id_dtype))
            (y * (_blk(G, 0, comm) if sp else G)).sum().backward()
            _close(y, _blk(yd.detach(), 0, comm) if sp else yd.detach(), f"{case}: forward", comm)
            _close(_gather_rows(layer.weight.grad, comm), dense.weight.grad, f"{case}: weight grad", comm)

    # Empty batches: right shapes, zero parameter grads, and every rank still in step.
    col = tp.ColumnParallelLinear.from_dense(_dense_linear(H, FFN, 1), comm, sequence_parallel=True)
    row = tp.RowParallelLinear.from_dense(_dense_linear(FFN, H, 3), comm, sequence_parallel=True)
    x = torch.zeros(0, B, H, dtype=F64, requires_grad=True)
    y = row(F.gelu(col(x)))
    assert y.shape == (0, B, H), y.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and not col.weight.grad.any() and not row.bias.grad.any()
    emb = tp.VocabParallelEmbedding.from_dense(_dense_embedding(5), comm)
    assert emb(torch.zeros(0, dtype=torch.int64)).shape == (0, H)


def _dense_roundtrip_body(comm) -> None:
    """to_dense(from_dense(l)) is l exactly (values, dtype, bias presence), without drawing from the global RNG."""
    for dtype in (F64, torch.float32, torch.bfloat16):
        for bias in (True, False):
            for cls, lin in ((tp.ColumnParallelLinear, _dense_linear(H, FFN, 7, bias, dtype)),
                             (tp.RowParallelLinear, _dense_linear(FFN, H, 9, bias, dtype))):
                rng = torch.random.get_rng_state()
                back = cls.from_dense(lin, comm).to_dense()
                assert torch.equal(torch.random.get_rng_state(), rng), "to_dense/from_dense drew from the global RNG"
                assert type(back) is nn.Linear and back.weight.dtype == dtype and (back.bias is None) == (not bias)
                assert torch.equal(back.weight, lin.weight), f"{cls.__name__} {dtype} weight round trip"
                if bias:
                    assert torch.equal(back.bias, lin.bias), f"{cls.__name__} {dtype} bias round trip"
        emb = _dense_embedding(11, dtype)
        back = tp.VocabParallelEmbedding.from_dense(emb, comm).to_dense()
        assert type(back) is nn.Embedding and torch.equal(back.weight, emb.weight), f"embedding {dtype} round trip"


def _init_body(comm) -> dict:
    """Seeded initialisation: returns the full weights (rank 0) so tests compare them across TP sizes."""
    col = tp.ColumnParallelLinear(H, FFN, comm, seed=11)
    row = tp.RowParallelLinear(FFN, H, comm, seed=12, dtype=torch.float32)
    emb = tp.VocabParallelEmbedding(V, H, comm, seed=13)
    torch.manual_seed(5)
    drawn1 = tp.ColumnParallelLinear(H, FFN, comm)  # seed=None: drawn from torch's generator on rank 0
    drawn2 = tp.ColumnParallelLinear(H, FFN, comm)
    # Several init blocks of rows, with shard edges inside blocks.
    big_col = tp.ColumnParallelLinear(16, 216, comm, seed=3)
    big_row = tp.RowParallelLinear(192, 144, comm, seed=4)
    out = {k: (m.to_dense().weight.detach(), getattr(m.to_dense(), "bias", None))
           for k, m in dict(col=col, row=row, emb=emb, drawn1=drawn1, drawn2=drawn2, big_col=big_col,
                            big_row=big_row).items()}
    out = {k: (w, None if b is None else b.detach()) for k, (w, b) in out.items()}
    gathered = comm.all_gather(out["drawn1"][0].unsqueeze(0))
    assert all(torch.equal(g, gathered[0]) for g in gathered), "seed=None: ranks built different layers"
    return out if comm.rank == 0 else {}


def _errors_body(comm) -> list[str]:
    """Bad sizes and misuse raise ValueError/TypeError naming the numbers, on every rank, with nobody left waiting."""
    n = comm.size
    msgs = []
    if n > 1:
        odd = 4 * n + 1
        msgs.append(_raises(ValueError, lambda: tp.ColumnParallelLinear(H, odd, comm, seed=0),
                            "out_features", str(odd), f"tensor-parallel size {n}"))
        msgs.append(_raises(ValueError, lambda: tp.RowParallelLinear(odd, H, comm, seed=0),
                            "in_features", str(odd), str(n)))
        msgs.append(_raises(ValueError, lambda: tp.VocabParallelEmbedding(odd, H, comm, seed=0),
                            "num_embeddings", str(odd), str(n)))
        row_sp = tp.RowParallelLinear(FFN, H, comm, sequence_parallel=True, seed=0)
        short = torch.randn(n + 1, FFN // n, dtype=row_sp.weight.dtype)
        msgs.append(_raises(ValueError, lambda: row_sp(short), "sequence", str(n + 1), str(n)))
        row = tp.RowParallelLinear(FFN, H, comm, seed=0)
        msgs.append(_raises(ValueError, lambda: row(torch.randn(3, FFN)), "input_is_parallel", str(FFN)))
        # A dense layer that differs between ranks would shard into garbage: every rank must refuse it.
        msgs.append(_raises(ValueError, lambda: tp.ColumnParallelLinear.from_dense(
            _dense_linear(H, FFN, 100 + comm.rank), comm), "differs between ranks"))
        msgs.append(_raises(ValueError, lambda: tp.scatter_to_tensor_parallel_region(torch.randn(2, n + 1), comm),
                            str(n + 1)))
    col = tp.ColumnParallelLinear(H, FFN, comm, seed=0)
    msgs.append(_raises(ValueError, lambda: col(torch.randn(3, H + 1)), str(H + 1), str(H)))
    msgs.append(_raises(ValueError, lambda: tp.ColumnParallelLinear(H, FFN, comm, gather_output=True,
                                                                    sequence_parallel=True), "gather_output"))
    msgs.append(_raises(ValueError, lambda: tp.RowParallelLinear(FFN, H, comm, input_is_parallel=False,
                                                                 sequence_parallel=True), "input_is_parallel"))
    msgs.append(_raises(ValueError, lambda: tp.ColumnParallelLinear(0, FFN, comm), "in_features"))
    emb = tp.VocabParallelEmbedding(V, H, comm, seed=0)
    msgs.append(_raises(ValueError, lambda: emb(torch.tensor([0, V])), str(V)))
    msgs.append(_raises(ValueError, lambda: emb(torch.tensor([-1, 2])), "-1"))
    msgs.append(_raises(TypeError, lambda: emb(torch.tensor([0.0]))))
    msgs.append(_raises(TypeError, lambda: tp.RowParallelLinear.from_dense(nn.Linear(4, 4), comm, gather_output=True)))
    msgs.append(_raises(ValueError, lambda: tp.VocabParallelEmbedding.from_dense(nn.Embedding(V, H, padding_idx=0),
                                                                                 comm), "padding_idx"))
    # Still in step: a collective after all the refusals completes with the right value.
    assert float(comm.all_reduce(torch.ones(1))) == n
    return msgs


def _train_body(comm) -> None:
    """MLP block (column -> GELU -> row) and embedding -> MLP -> tied output vs dense, over AdamW steps."""
    n = comm.size
    for sp in (False, True):
        # -- MLP block, loss = mean squared error; under sequence parallelism each rank owns its rows' share.
        fc1d, fc2d = _dense_linear(H, FFN, 1), _dense_linear(FFN, H, 3)
        fc1 = tp.ColumnParallelLinear.from_dense(fc1d, comm, sequence_parallel=sp)
        fc2 = tp.RowParallelLinear.from_dense(fc2d, comm, sequence_parallel=sp)
        opt_d = torch.optim.AdamW([*fc1d.parameters(), *fc2d.parameters()], lr=1e-2)
        opt = torch.optim.AdamW([*fc1.parameters(), *fc2.parameters()], lr=1e-2)
        for step in range(3):
            case = f"mlp sequence_parallel={sp} step {step}"
            X, T = _rand(100 + step, S, B, H), _rand(200 + step, S, B, H)
            xd = X.clone().requires_grad_()
            loss_d = ((fc2d(F.gelu(fc1d(xd))) - T) ** 2).sum() / T.numel()
            loss_d.backward()
            x = (_blk(X, 0, comm) if sp else X).clone().requires_grad_()
            y = fc2(F.gelu(fc1(x)))
            loss = ((y - (_blk(T, 0, comm) if sp else T)) ** 2).sum() / T.numel()
            loss.backward()
            total = comm.all_reduce(loss.detach().reshape(1))[0] if sp else loss.detach()
            _close(total, loss_d.detach(), f"{case}: loss", comm)
            _close(x.grad, _blk(xd.grad, 0, comm) if sp else xd.grad, f"{case}: input grad", comm)
            _close(fc2.bias.grad, fc2d.bias.grad, f"{case}: row bias grad", comm)
            opt_d.step(), opt.step(), opt_d.zero_grad(), opt.zero_grad()
        _close(fc1.to_dense().weight, fc1d.weight, f"mlp sp={sp}: fc1 weight after steps", comm)
        _close(fc1.to_dense().bias, fc1d.bias, f"mlp sp={sp}: fc1 bias after steps", comm)
        _close(fc2.to_dense().weight, fc2d.weight, f"mlp sp={sp}: fc2 weight after steps", comm)
        _close(fc2.to_dense().bias, fc2d.bias, f"mlp sp={sp}: fc2 bias after steps", comm)

        # -- embedding -> residual MLP -> logits with the tied (vocab-parallel) embedding -> cross entropy.
        embd, fc1d, fc2d = _dense_embedding(21), _dense_linear(H, FFN, 23), _dense_linear(FFN, H, 25)
        emb = tp.VocabParallelEmbedding.from_dense(embd, comm, sequence_parallel=sp)
        fc1 = tp.ColumnParallelLinear.from_dense(fc1d, comm, sequence_parallel=sp)
        fc2 = tp.RowParallelLinear.from_dense(fc2d, comm, sequence_parallel=sp)
        opt_d = torch.optim.AdamW([*embd.parameters(), *fc1d.parameters(), *fc2d.parameters()], lr=1e-2)
        opt = torch.optim.AdamW([*emb.parameters(), *fc1.parameters(), *fc2.parameters()], lr=1e-2)
        for step in range(3):
            case = f"chain sequence_parallel={sp} step {step}"
            ids, labels = _ids(300 + step, S, B), _ids(400 + step, S, B)
            h = embd(ids)
            h = h + fc2d(F.gelu(fc1d(h)))
            logits_d = F.linear(h, embd.weight)
            loss_d = F.cross_entropy(logits_d.reshape(-1, V), labels.reshape(-1))
            loss_d.backward()
            h = emb(ids)
            h = h + fc2(F.gelu(fc1(h)))
            h_total = (tp.gather_from_sequence_parallel_region(h, comm) if sp
                       else tp.copy_to_tensor_parallel_region(h, comm))
            logits = tp.gather_from_tensor_parallel_region(F.linear(h_total, emb.weight), comm)  # [S, B, V]
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))  # the same on every rank
            loss.backward()
            _close(logits, logits_d.detach(), f"{case}: logits", comm)
            _close(loss, loss_d, f"{case}: loss", comm)
            _close(_gather_rows(emb.weight.grad, comm), embd.weight.grad, f"{case}: tied embedding grad", comm)
            opt_d.step(), opt.step(), opt_d.zero_grad(), opt.zero_grad()
        _close(emb.to_dense().weight, embd.weight, f"chain sp={sp}: embedding after steps", comm)
        _close(fc1.to_dense().weight, fc1d.weight, f"chain sp={sp}: fc1 after steps", comm)
        _close(fc2.to_dense().weight, fc2d.weight, f"chain sp={sp}: fc2 after steps", comm)
        _close(fc2.to_dense().bias, fc2d.bias, f"chain sp={sp}: fc2 bias after steps", comm)
    assert n == comm.size


def _subgroup_body(comm) -> None:
    """TP groups that are sub-communicators (as under TP x DP): groups of 2 ranks, each with its own data."""
    if comm.size % 2:
        return
    group = comm.split(comm.rank // 2)
    try:
        replica = comm.rank // 2
        fc1d, fc2d = _dense_linear(H, FFN, 1), _dense_linear(FFN, H, 3)
        fc1 = tp.ColumnParallelLinear.from_dense(fc1d, group, sequence_parallel=True)
        fc2 = tp.RowParallelLinear.from_dense(fc2d, group, sequence_parallel=True)
        X, G = _rand(600 + replica, S, B, H), _rand(700 + replica, S, B, H)
        xd = X.clone().requires_grad_()
        yd = fc2d(F.gelu(fc1d(xd)))
        (yd * G).sum().backward()
        x = _blk(X, 0, group).clone().requires_grad_()
        y = fc2(F.gelu(fc1(x)))
        (y * _blk(G, 0, group)).sum().backward()
        _close(y, _blk(yd.detach(), 0, group), f"subgroup {replica}: forward", group)
        _close(x.grad, _blk(xd.grad, 0, group), f"subgroup {replica}: input grad", group)
        _close(_gather_rows(fc1.weight.grad, group), fc1d.weight.grad, f"subgroup {replica}: fc1 weight grad", group)
        _close(fc2.bias.grad, fc2d.bias.grad, f"subgroup {replica}: fc2 bias grad", group)
    finally:
        group.close()


_CHECKS = {"regions": _regions_body, "subgroups": _subgroup_body, "layers": _layers_body,
           "round_trip": _dense_roundtrip_body,
           "errors": _errors_body, "init": _init_body, "train": _train_body}


def _all_checks(comm) -> dict:
    """Every check in one launch (a launched rank pays ~1-2 s of one-time torch warm-up), each result kept apart.

    A check that fails on every rank leaves them in step; one that fails on some ranks only makes
    the later checks fail too (the Communicator refuses mismatched calls), so read the first failure.
    """
    return run_checks(_CHECKS, comm)


@pytest.fixture(scope="module")
def tp_run():
    cache: dict[int, list] = {}

    def get(n: int, name: str) -> list:
        if n not in cache:
            cache[n] = collectives.launch(_all_checks, n, timeout=120)
        fails = [(r, res[name][1]) for r, res in enumerate(cache[n]) if res[name][0] == "fail"]
        if fails:
            pytest.fail(f"tp={n}: check {name!r} failed on ranks {[r for r, _ in fails]}; rank {fails[0][0]}:\n"
                        f"{fails[0][1]}", pytrace=False)
        return [res[name][1] for res in cache[n]]

    return get


@pytest.mark.parametrize("n", TP_SIZES)
def test_region_functions_forward_and_backward(n, tp_run):
    tp_run(n, "regions")


@pytest.mark.parametrize("n", TP_SIZES)
def test_layers_match_dense_forward_and_grads(n, tp_run):
    tp_run(n, "layers")


@pytest.mark.parametrize("n", [2, 4])
def test_layers_on_sub_communicators(n, tp_run):
    tp_run(n, "subgroups")


@pytest.mark.parametrize("n", TP_SIZES)
def test_from_dense_to_dense_round_trip_exact(n, tp_run):
    tp_run(n, "round_trip")


@pytest.mark.parametrize("n", TP_SIZES)
def test_mlp_and_tied_embedding_chain_train_like_dense(n, tp_run):
    tp_run(n, "train")


@pytest.mark.parametrize("n", TP_SIZES)
def test_errors_are_loud_and_leave_ranks_in_step(n, tp_run):
    msgs = tp_run(n, "errors")
    # The same refusals on every rank, up to the rank each message names.
    same = [[re.sub(r"rank \d+", "rank R", m) for m in ms] for ms in msgs]
    assert all(ms == same[0] for ms in same[1:]), f"ranks raised different errors: {msgs}"
    assert n == 1 or any(" on rank 1: " in m for m in msgs[1])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_init_is_the_same_function_for_every_tp_size(n, tp_run):
    ref, got = tp_run(1, "init")[0], tp_run(n, "init")[0]
    for k, (w, b) in ref.items():
        assert torch.equal(got[k][0], w), f"{k}: weight differs between tp=1 and tp={n}"
        assert (b is None and got[k][1] is None) or torch.equal(got[k][1], b), f"{k}: bias differs at tp={n}"


def test_init_distribution(tp_run):
    init = tp_run(1, "init")[0]
    w, b = init["col"]
    bound = 1 / math.sqrt(H)
    assert w.shape == (FFN, H) and b.shape == (FFN,) and w.dtype == torch.get_default_dtype()
    assert w.abs().max() <= bound and b.abs().max() <= bound
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.15 * bound  # U(-a, a) has std a / sqrt(3)
    assert init["row"][0].dtype == torch.float32 and init["row"][0].shape == (H, FFN)
    e = init["emb"][0]
    assert abs(e.mean().item()) < 0.2 and abs(e.std().item() - 1) < 0.15  # N(0, 1), 432 samples
    assert init["big_col"][0].shape == (216, 16) and init["big_row"][0].shape == (144, 192)
    assert init["big_row"][0].abs().max() <= 1 / math.sqrt(192)
    # Distinct seeds (and successive seed=None draws) give distinct layers.
    assert not torch.equal(init["drawn1"][0], init["drawn2"][0])
    assert not torch.equal(init["drawn1"][0], w)


# ---- one rank with a bad argument ------------------------------------------------------------------
def _outcome(comm, fn) -> tuple[str, str]:
    """What ``fn`` raised here. A rank that got through joins a collective, where a peer's refusal reaches it."""
    try:
        fn()
        comm.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e)
    return "no error", ""


def _one_rank_wrong_cases(n: int) -> dict:
    """case -> (the bad rank, what runs there, what runs on the others, expected (type, text) on the bad rank,
    on the others). Built the same on every rank."""
    d64 = dict(dtype=F64, seed=0)
    cases = {}

    def case(name, bad_call, good_call, bad_expect, peer_expect=None):
        bad = len(cases) % n  # the bad rank moves around, so rank 0 (the seed and fingerprint reference) is one too
        cases[name] = (bad, bad_call, good_call, bad_expect, peer_expect or bad_expect)

    # constructors and from_dense: one agreement, the same message on every rank
    case("column out_features", lambda c: tp.ColumnParallelLinear(H, FFN + 1, c, seed=0),
         lambda c: tp.ColumnParallelLinear(H, FFN, c, seed=0),
         ("ValueError", f"out_features {FFN + 1} is not divisible by the tensor-parallel size {n}"))
    case("row options", lambda c: tp.RowParallelLinear(FFN, H, c, input_is_parallel=False, sequence_parallel=True),
         lambda c: tp.RowParallelLinear(FFN, H, c, input_is_parallel=False), ("ValueError", "needs input_is_parallel"))
    case("embedding vocabulary", lambda c: tp.VocabParallelEmbedding(V + 1, H, c, seed=0),
         lambda c: tp.VocabParallelEmbedding(V, H, c, seed=0),
         ("ValueError", f"num_embeddings {V + 1} is not divisible"))
    case("seed type", lambda c: tp.ColumnParallelLinear(H, FFN, c, seed="7"),
         lambda c: tp.ColumnParallelLinear(H, FFN, c, seed=7), ("TypeError", "seed must be an int or None"))
    case("seed drawn on one rank only", lambda c: tp.ColumnParallelLinear(H, FFN, c),
         lambda c: tp.ColumnParallelLinear(H, FFN, c, seed=7), ("ValueError", "ranks disagree on seed"))
    case("dtype", lambda c: tp.RowParallelLinear(FFN, H, c, dtype=torch.float32, seed=0),
         lambda c: tp.RowParallelLinear(FFN, H, c, **d64), ("ValueError", "ranks disagree on dtype"))
    case("from_dense of an embedding", lambda c: tp.ColumnParallelLinear.from_dense(_dense_embedding(1), c),
         lambda c: tp.ColumnParallelLinear.from_dense(_dense_linear(H, FFN, 1), c),
         ("TypeError", "needs a torch.nn.Linear, got Embedding"))
    case("reset_parameters seed", lambda c: tp.VocabParallelEmbedding(V, H, c, seed=0).reset_parameters(),
         lambda c: tp.VocabParallelEmbedding(V, H, c, seed=0).reset_parameters(seed=3),
         ("ValueError", "ranks disagree on seed"))
    # forward checks: this rank refuses its input, the peers' next collective raises
    peers = ("ValueError", "rejected their input")
    case("row input width", lambda c, m: m["row"](_rand(1, 3, FFN // n + 1)),
         lambda c, m: m["row"](_rand(1, 3, FFN // n)), ("ValueError", f"expected last dim {FFN // n}"), peers)
    case("column input dtype", lambda c, m: m["row"](F.gelu(m["col"](_rand(2, 3, H).float()))),
         lambda c, m: m["row"](F.gelu(m["col"](_rand(2, 3, H)))), ("TypeError", "x has dtype torch.float32"), peers)
    case("sequence-parallel column width", lambda c, m: m["col_sp"](_rand(3, 2, H - 1)),
         lambda c, m: m["col_sp"](_rand(3, 2, H)), ("ValueError", f"expected last dim {H}"), peers)
    case("sequence-parallel row sequence length", lambda c, m: m["row_sp"](_rand(4, n + 1, FFN // n)),
         lambda c, m: m["row_sp"](_rand(4, n, FFN // n)),
         ("ValueError", f"shape ({n + 1}, {H}) = {n + 1} is not divisible"), peers)
    case("embedding ids out of range", lambda c, m: m["emb"](torch.tensor([0, V])),
         lambda c, m: m["emb"](torch.tensor([0, V - 1])), ("ValueError", f"valid ids are in [0, {V})"), peers)
    case("embedding float ids", lambda c, m: m["emb"](torch.tensor([0.0])),
         lambda c, m: m["emb"](torch.tensor([0])), ("TypeError", "ids must be an int64 or int32 tensor"), peers)
    case("scatter_to region width", lambda c, m: tp.scatter_to_tensor_parallel_region(_rand(5, 2, n + 1), c),
         lambda c, m: tp.scatter_to_tensor_parallel_region(_rand(5, 2, n), c), ("ValueError", f"= {n + 1} is not"),
         peers)
    case("gather_from_sequence region 0-d", lambda c, m: tp.gather_from_sequence_parallel_region(_rand(6, 1)[0], c),
         lambda c, m: tp.gather_from_sequence_parallel_region(_rand(6, 1), c), ("ValueError", "0-d"), peers)
    return cases


def _one_rank_wrong_body(comm) -> dict[str, tuple[str, str]]:
    layers = dict(row=tp.RowParallelLinear(FFN, H, comm, dtype=F64, seed=1),
                  col=tp.ColumnParallelLinear(H, FFN, comm, dtype=F64, seed=2),
                  col_sp=tp.ColumnParallelLinear(H, FFN, comm, dtype=F64, seed=3, sequence_parallel=True),
                  row_sp=tp.RowParallelLinear(FFN, H, comm, dtype=F64, seed=4, sequence_parallel=True),
                  emb=tp.VocabParallelEmbedding(V, H, comm, dtype=F64, seed=5))
    out = {}
    for name, (bad, bad_call, good_call, _, _) in _one_rank_wrong_cases(comm.size).items():
        call = bad_call if comm.rank == bad else good_call
        args = (comm,) if call.__code__.co_argcount == 1 else (comm, layers)
        out[name] = _outcome(comm, lambda: call(*args))
    assert float(comm.all_reduce(torch.ones(1))) == comm.size, "ranks out of step after the refusals"
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_one_rank_with_a_bad_argument_fails_every_rank_at_once(n):
    # A rank left waiting would raise CollectiveTimeoutError after 30 s instead of the expected error.
    per_rank = collectives.launch(_one_rank_wrong_body, n, timeout=30)
    wrong = []
    for name, (bad, _, _, bad_expect, peer_expect) in _one_rank_wrong_cases(n).items():
        for r, outcomes in enumerate(per_rank):
            kind, text = bad_expect if r == bad else peer_expect
            got = outcomes[name]
            ok = got[0] == kind and text in got[1] and f"rank {bad}" in got[1].replace("rank(s) [", "rank ")
            if not ok:
                wrong.append(f"{name}: rank {r} raised {got[0]}: {got[1]!r}; expected {kind} with {text!r} "
                             f"naming rank {bad}")
    assert not wrong, "\n".join(wrong)
