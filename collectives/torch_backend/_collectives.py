"""The collectives of the moecomm process group, each on the group's Communicator.

torch's c10d operators call these methods (``dist.all_reduce`` and friends, DDP's reducer,
``_broadcast_coalesced``, the functional collectives) on the group's Backend (the trampoline of
``_native``), or, without it, torch calls them on the Python ProcessGroup itself. Both
the torch 2.13 names and the older ones exist (``all_gather_single`` / ``_allgather_base``,
``reduce_scatter_single`` / ``_reduce_scatter_base``, ``all_to_all_single`` / ``alltoall_base``,
the ``*_coalesced`` pairs), so torch 2.5 through 2.13 find what they look up.

Reduce, gather, scatter and uneven all-gather have no call of their own in the Communicator:
reduce is an all-reduce whose result only the root keeps; gather, scatter and uneven all-gather are
uneven all-to-alls in which only the ranks that need data receive it; uneven reduce-scatter is an
all-reduce of which each rank keeps its block. Dtypes the Communicator does not move (float8,
int8, int16, complex) travel as bytes in the collectives that only move data; int8 is reduced as
uint8 (``_ops.int8_wire``), with int8 in the call's signature.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist

from transports.base import SUPPORTED_DTYPES, dtype_code, dtype_name

from ._ops import completed, flat_view, int8_unwire_, int8_wire, option, plain, reduction, unwire, wire, wire_count


class Collectives:
    """The collective methods of a moecomm group (``_group.GroupOps``).

    A mixin: the class it is mixed into is a c10d ``Backend`` or ``ProcessGroup`` (``rank()``,
    ``size()``) with ``comm`` (its Communicator) and ``_global_ranks`` ([size] world ranks).
    """

    comm: Any
    _global_ranks: list[int]

    # ---- helpers ------------------------------------------------------------------------------
    def _reject(self, error: Exception, t: torch.Tensor | None = None) -> NoReturn:
        """Raise ``error`` here and make the peers' matching call raise too."""
        self.comm.reject(error, device=t.device.type if t is not None else "cpu")

    def _me(self) -> int:
        return self._global_ranks[self.rank()]

    def _op(self, op: Any, t: torch.Tensor) -> tuple[str, Any]:
        try:
            return reduction(op, t.dtype)
        except TypeError as e:
            self._reject(TypeError(f"rank {self._me()}: {e}"), t)

    def _one(self, tensors: Any, what: str) -> torch.Tensor:
        """The single tensor of a tensor list (torch >= 2.0 passes one tensor per rank)."""
        if isinstance(tensors, torch.Tensor):
            return plain(tensors)
        if len(tensors) != 1:
            self._reject(ValueError(f"{what}: rank {self._me()} passed {len(tensors)} tensors; moecomm takes one "
                                    "tensor per rank"), tensors[0] if tensors else None)
        return plain(tensors[0])

    def _written(self, out: torch.Tensor, fill: Any) -> None:
        """Call ``fill(dst)`` with a 1-d wire view of ``out`` (a temporary when out is not contiguous)."""
        if out.is_contiguous():
            fill(wire(flat_view(out)))
            return
        tmp = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        fill(wire(tmp))
        out.copy_(tmp.view(out.shape))

    @staticmethod
    def _logical(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype | None]:
        """(shape, dtype) to show the peers for ``wire(t)``: t's shape (its last dim in bytes when
        t moves as bytes) and t's dtype when it moves as bytes (else None), for ``call_as``."""
        if t.dtype in SUPPORTED_DTYPES:
            return tuple(t.shape), None
        shape = tuple(t.shape) or (1,)
        return (*shape[:-1], shape[-1] * t.element_size()), t.dtype

    def _reduce_into(self, t: torch.Tensor, name: str, factor: Any) -> None:
        """All-reduce ``t`` in place (PREMUL_SUM: scaled first)."""
        if factor is not None:
            t.mul_(factor)
        self._all_reduce(t, name, out=t)

    def _all_reduce(self, x: torch.Tensor, name: str, *, out: torch.Tensor | None = None,
                    root: int | None = None) -> torch.Tensor:
        """The communicator's all_reduce of ``x`` with op ``name`` (``root`` given: torch's reduce, an
        all_reduce whose result only ``root`` keeps). int8, which the communicator does not reduce,
        goes as uint8 (:func:`int8_wire`) with int8 in the signature (ranks passing uint8 raise)."""
        if x.dtype != torch.int8:
            if root is None:
                return self.comm.all_reduce(x, name, out=out)
            return self.comm.call_as("reduce", x, op=name, root=root, out=out)
        res = self.comm.call_as("all_reduce" if root is None else "reduce", int8_wire(x, name), op=name,
                                root=root or 0, dtype=torch.int8, out=None if out is None else out.view(torch.uint8))
        return int8_unwire_(res, name)

    def _reduce_scatter(self, x: torch.Tensor, name: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The communicator's reduce_scatter of ``x`` with op ``name``; int8 as in :meth:`_all_reduce`
        (``out`` may be int8 or its uint8 wire view)."""
        if x.dtype != torch.int8:
            return self.comm.reduce_scatter(x, name, out=out)
        res = self.comm.call_as("reduce_scatter", int8_wire(x, name), op=name, dtype=torch.int8,
                                out=None if out is None else out.view(torch.uint8))
        return int8_unwire_(res, name)

    # ---- all-reduce ---------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> dist.Work:
        """In-place all-reduce of the group's tensors (``dist.all_reduce``; DDP's buckets).

        Args:
            tensors: [1] list of one tensor [*] (or the tensor itself), any supported dtype.
            opts: ``AllreduceOptions`` (its ``reduceOp``), or a ``ReduceOp`` (older overload).

        Returns:
            A finished Work; its future holds ``tensors``.
        """
        op = opts if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) else option(opts, "reduceOp", dist.ReduceOp.SUM)
        t = self._one(tensors, "all_reduce")
        if t.layout == torch.sparse_coo:
            self._sparse_all_reduce(t, op)
            return completed(tensors if isinstance(tensors, list) else [tensors], [t])
        name, factor = self._op(op, t)
        self._reduce_into(t, name, factor)
        return completed(tensors if isinstance(tensors, list) else [tensors], [t])

    def _sparse_all_reduce(self, t: torch.Tensor, op: Any) -> None:
        """Sum a sparse COO tensor over the group in place, as gloo does (DDP with sparse embeddings).

        Each rank's coalesced indices and values are all-gathered (nnz differs between ranks), then
        summed in rank order and coalesced: ``t`` becomes the coalesced sum (gloo's result, bit for
        bit). Shapes, dtypes or sparse dims that differ raise ValueError on every rank, naming them.

        Args:
            t: a sparse COO tensor [*sparse dims, *dense dims]; any dtype.
            op: SUM (gloo's only op for sparse tensors).
        """
        if getattr(op, "op", op) != dist.ReduceOp.RedOpType.SUM:
            self._reject(TypeError(f"all_reduce: rank {self._me()} passed reduce op {getattr(op, 'op', op)} for a "
                                   "sparse tensor; sparse all_reduce sums (ReduceOp.SUM), as in gloo"), t.values())
        x = t.coalesce()
        n, dims = self.size(), 16
        if x.dim() > dims:
            self._reject(ValueError(f"all_reduce: rank {self._me()} passed a sparse tensor of {x.dim()} dims; "
                                    f"moecomm's sparse all_reduce takes up to {dims}"), x.values())
        meta = torch.full((1, 4 + dims), -1, dtype=torch.int64)
        meta[0, :4] = torch.tensor([x._nnz(), x.sparse_dim(), x.dim(), dtype_code(x.dtype)])
        meta[0, 4:4 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
        metas = self.comm.all_gather(meta)  # [n, 4 + dims]: nnz, sparse dims, dims, dtype, shape
        if not bool((metas[:, 1:] == metas[0, 1:]).all()):
            shown = ", ".join(
                f"rank {self._global_ranks[r]}: {tuple(m[4:4 + int(m[2])])} {dtype_name(int(m[3]))} "
                f"with {int(m[1])} sparse dims" for r, m in enumerate(metas.tolist()))
            raise ValueError(f"all_reduce: the sparse tensors differ across ranks ({shown}); every rank must pass "
                             "the same shape, dtype and number of sparse dims")
        counts = [int(c) for c in metas[:, 0]]
        idx = x.indices().t().contiguous()  # [nnz, sparse dims]
        val = x.values().contiguous()  # [nnz, *dense dims]
        moved = val if val.dtype in SUPPORTED_DTYPES else val.unsqueeze(-1).view(torch.uint8)
        all_idx = self.comm.all_to_all(idx.repeat(n, 1), [idx.shape[0]] * n, recv_counts=counts)
        all_val = self.comm.all_to_all(moved.repeat(n, *[1] * (moved.dim() - 1)), [moved.shape[0]] * n,
                                       recv_counts=counts)
        if val.dtype not in SUPPORTED_DTYPES:
            all_val = all_val.view(val.dtype).squeeze(-1)
        total = torch.sparse_coo_tensor(all_idx.t(), all_val, x.shape, dtype=x.dtype).coalesce()
        t.copy_(total)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """All-reduce several tensors in place with one call per dtype and device.

        Args:
            tensors: [k] tensors of any shapes; the same list on every rank.
            opts: ``AllreduceCoalescedOptions`` (its ``reduceOp``).

        Returns:
            A finished Work; its future holds ``tensors``.
        """
        op = option(opts, "reduceOp", dist.ReduceOp.SUM)
        detached = [plain(t) for t in tensors]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in detached:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for members in groups.values():  # first-appearance order: the same on every rank
            name, factor = self._op(op, members[0])
            if len(members) == 1 and members[0].is_contiguous():
                self._reduce_into(members[0], name, factor)
                continue
            flat = torch.cat([flat_view(t) for t in members])
            self._reduce_into(flat, name, factor)
            offset = 0
            for t in members:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
        return completed(list(tensors), detached)

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None) -> dist.Work:
        """Reduce onto ``opts.rootRank`` (an all-reduce whose result only the root keeps).

        Args:
            tensors: [1] list of one tensor [*]; on the root it receives the result, elsewhere it
                is left unchanged.
            opts: ``ReduceOptions`` (``rootRank``, ``reduceOp``), or the root (older overload).
            op: the ``ReduceOp`` of the older overload.

        Returns:
            A finished Work; its future holds ``tensors``.
        """
        if isinstance(opts, int):
            root, rop = opts, op if op is not None else dist.ReduceOp.SUM
        else:
            root, rop = option(opts, "rootRank", 0), option(opts, "reduceOp", dist.ReduceOp.SUM)
        t = self._one(tensors, "reduce")
        name, factor = self._op(rop, t)
        src = t * factor if factor is not None else t
        # the root in the signature: ranks that pass different dsts raise instead of losing the sum
        result = self._all_reduce(src, name, root=root)
        if self.rank() == root:
            t.copy_(result)
        return completed(tensors if isinstance(tensors, list) else [tensors], [t])

    # ---- broadcast / barrier ------------------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None) -> dist.Work:
        """Every rank's tensor becomes the root's (``dist.broadcast``; DDP's parameter sync).

        Args:
            tensors: [1] list of one tensor [*] (or the tensor itself), any dtype.
            opts: ``BroadcastOptions`` (``rootRank``), or the root rank (older overload).

        Returns:
            A finished Work; its future holds ``tensors``.
        """
        root = opts if isinstance(opts, int) else option(opts, "rootRank", 0)
        t = self._one(tensors, "broadcast")
        src = wire(flat_view(t))
        shape, moved_as = self._logical(t)
        self._written(t, lambda dst: self.comm.call_as("broadcast", src.view(shape), root=root, dtype=moved_as,
                                                        out=dst.view(shape)))
        return completed(tensors if isinstance(tensors, list) else [tensors], [t])

    def barrier(self, opts: Any = None) -> dist.Work:
        """Returns once every rank of the group has called it (bounded by the timeout).

        Returns:
            A finished Work; its future holds an empty list.
        """
        self.comm.barrier()
        return completed([])

    # ---- all-gather ---------------------------------------------------------------------------
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor``: every rank's input, in rank order, into one tensor.

        Args:
            output: [size * n, *rest] or [size, n, *rest] (any shape of size x input.numel()
                elements), input's dtype.
            input: [n, *rest], the same shape on every rank; any dtype.

        Returns:
            A finished Work; its future holds [output].
        """
        out, inp = plain(output), plain(input)
        if out.numel() != self.size() * inp.numel() or out.dtype != inp.dtype:
            self._reject(ValueError(
                f"all_gather_into_tensor: rank {self._me()} passed an output of {out.numel()} {out.dtype} elements "
                f"for an input of {inp.numel()} {inp.dtype}; it needs group size {self.size()} x "
                f"{inp.numel()} elements of the input's dtype"), inp)
        src = wire(flat_view(inp))
        if inp.dtype in SUPPORTED_DTYPES:
            self._written(out, lambda dst: self.comm.all_gather(src, out=dst))
        else:  # moved as bytes: the peers see the dtype and the shape
            shape, moved_as = self._logical(inp)
            self._written(out, lambda dst: self.comm.call_as("all_gather", src.view(shape), dtype=moved_as,
                                                              out=dst.view(self.size() * shape[0], *shape[1:])))
        return completed([output], [out])

    _allgather_base = all_gather_single

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:
        """``dist.all_gather``: rank r's input into ``output_tensors[0][r]`` on every rank.

        Sizes may differ between ranks (each output tensor has the size of that rank's input):
        then the data moves as one uneven all-to-all.

        Args:
            output_tensors: [1] list of [size] tensors (or the [size] list itself), input's dtype.
            input_tensors: [1] list of one tensor (or the tensor itself).

        Returns:
            A finished Work; its future holds ``output_tensors``.
        """
        outs = output_tensors[0] if output_tensors and isinstance(output_tensors[0], (list, tuple)) else output_tensors
        outs = [plain(o) for o in outs]
        x = self._one(input_tensors, "all_gather")
        n = self.size()
        if len(outs) != n or any(o.dtype != x.dtype for o in outs):
            self._reject(ValueError(f"all_gather: rank {self._me()} passed {len(outs)} output tensors of dtypes "
                                    f"{sorted({str(o.dtype) for o in outs})}; need {n} of the input's dtype {x.dtype}"),
                         x)
        src = wire(flat_view(x))
        if all(o.numel() == x.numel() for o in outs):
            if x.dtype in SUPPORTED_DTYPES:
                gathered = self.comm.all_gather(src).view(n, -1)
            else:  # moved as bytes: the peers see the dtype and the shape
                shape, moved_as = self._logical(x)
                gathered = self.comm.call_as("all_gather", src.view(shape), dtype=moved_as).view(n, -1)
            for r, o in enumerate(outs):
                o.copy_(unwire(gathered[r], o))
        else:  # uneven: rank r's input goes to every rank
            recv_counts = [wire_count(o) for o in outs]
            got = self.comm.all_to_all(src.repeat(n), [src.numel()] * n, recv_counts=recv_counts)
            offset = 0
            for o, c in zip(outs, recv_counts):
                o.copy_(unwire(got[offset:offset + c], o))
                offset += c
        return completed(output_tensors, outs)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        """``dist.all_gather_coalesced``: :meth:`allgather` for each input in turn.

        Args:
            output_lists: [size] lists of [k] tensors: ``output_lists[r][i]`` receives rank r's
                ``input_list[i]`` (torch's layout: one list per rank, as gloo reads it).
            input_list: [k] tensors.

        Returns:
            A finished Work; its future holds ``output_lists``.
        """
        n = self.size()
        if len(output_lists) != n or any(len(outs) != len(input_list) for outs in output_lists):
            self._reject(ValueError(
                f"all_gather_coalesced: rank {self._me()} passed {len(output_lists)} output lists of "
                f"{sorted({len(outs) for outs in output_lists})} tensors for {len(input_list)} inputs; need {n} "
                f"lists (one per rank) of {len(input_list)} tensors"), input_list[0] if input_list else None)
        for i, x in enumerate(input_list):
            self.allgather([[output_lists[r][i] for r in range(n)]], [x])
        return completed(output_lists, [o for outs in output_lists for o in outs])

    @staticmethod
    def _coalesce(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                  block_fits: Callable[[torch.Tensor, torch.Tensor], bool],
                  one_pair: Callable[[torch.Tensor, torch.Tensor], Any]) -> tuple[list, list, bool]:
        """(inputs, outputs, whether one call can move every pair): when the pairs' sizes do not fit
        ``block_fits(out, in)`` or dtypes/devices mix, each pair goes through ``one_pair`` here."""
        ins, outs = [plain(x) for x in inputs], [plain(o) for o in outputs]
        if len(ins) == len(outs) and all(block_fits(o, x) for o, x in zip(outs, ins)) and \
                len({(x.dtype, x.device) for x in ins + outs}) <= 1:
            return ins, outs, True
        for o, x in zip(outs, ins):
            one_pair(o, x)
        return ins, outs, False

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """:meth:`all_gather_single` of several pairs; one call when all inputs share a dtype.

        Returns:
            A finished Work; its future holds ``outputs``.
        """
        n = self.size()
        ins, outs, fits = self._coalesce(outputs, inputs, lambda o, x: o.numel() == n * x.numel(),
                                         self.all_gather_single)
        if not fits:
            return completed(list(outputs), outs)
        flat = [wire(flat_view(x)) for x in ins]
        gathered = self.comm.all_gather(torch.cat(flat)).view(n, -1)
        offset = 0
        for o, f in zip(outs, flat):
            o.copy_(unwire(gathered[:, offset:offset + f.numel()], o))
            offset += f.numel()
        return completed(list(outputs), outs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce-scatter -----------------------------------------------------------------------
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor``: the reduction of every rank's input, this rank's block.

        Args:
            output: [n, *rest] (any shape of input.numel() / size elements), input's dtype.
            input: [size * n, *rest] or [size, n, *rest], the same shape on every rank.
            opts: ``ReduceScatterOptions`` (``reduceOp``: SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM).

        Returns:
            A finished Work; its future holds [output].
        """
        out, inp = plain(output), plain(input)
        if inp.numel() != self.size() * out.numel() or out.dtype != inp.dtype:
            self._reject(ValueError(
                f"reduce_scatter_tensor: rank {self._me()} passed an input of {inp.numel()} {inp.dtype} elements "
                f"for an output of {out.numel()} {out.dtype}; it needs group size {self.size()} x "
                f"{out.numel()} elements of the output's dtype"), inp)
        name, factor = self._op(option(opts, "reduceOp", dist.ReduceOp.SUM), inp)
        src = flat_view(inp) * factor if factor is not None else flat_view(inp)
        self._written(out, lambda dst: self._reduce_scatter(src, name, out=dst))
        return completed([output], [out])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None, op: Any = None,
                       timeout: Any = None) -> dist.Work:
        """``dist.reduce_scatter``: this rank's output = the reduction of every rank's
        ``input_tensors[0][rank]``; blocks may differ in size between ranks.

        Args:
            output_tensors: [1] list of one tensor (or the tensor itself).
            input_tensors: [1] list of [size] tensors (or the [size] list itself), output's dtype.
            opts: ``ReduceScatterOptions`` (``reduceOp``), or a ``ReduceOp`` (older overload).

        Returns:
            A finished Work; its future holds ``output_tensors``.
        """
        y = self._one(output_tensors, "reduce_scatter")
        xs = input_tensors[0] if input_tensors and isinstance(input_tensors[0], (list, tuple)) else input_tensors
        xs = [plain(x) for x in xs]
        n = self.size()
        if len(xs) != n or any(x.dtype != y.dtype for x in xs):
            self._reject(ValueError(f"reduce_scatter: rank {self._me()} passed {len(xs)} input tensors; need {n} "
                                    f"of the output's dtype {y.dtype}"), y)
        rop = opts if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) else \
            (op if op is not None else option(opts, "reduceOp", dist.ReduceOp.SUM))
        name, factor = self._op(rop, y)
        flat = torch.cat([flat_view(x) for x in xs])
        if factor is not None:
            flat.mul_(factor)
        if all(x.numel() == y.numel() for x in xs):
            y.copy_(self._reduce_scatter(flat, name).view(y.shape))
        else:  # uneven blocks: reduce everything, keep this rank's block
            total = self._all_reduce(flat, name)
            start = sum(x.numel() for x in xs[:self.rank()])
            y.copy_(total[start:start + y.numel()].view(y.shape))
        return completed(output_tensors if isinstance(output_tensors, list) else [output_tensors], [y])

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        """:meth:`reduce_scatter_single` of several pairs; one call when all share a dtype.

        Returns:
            A finished Work; its future holds ``outputs``.
        """
        n = self.size()
        ins, outs, fits = self._coalesce(outputs, inputs, lambda o, x: x.numel() == n * o.numel(),
                                         lambda o, x: self.reduce_scatter_single(o, x, opts))
        if not fits:
            return completed(list(outputs), outs)
        name, factor = self._op(option(opts, "reduceOp", dist.ReduceOp.SUM), ins[0])
        # rank r's block of every input, side by side: one reduce-scatter moves them all
        send = torch.cat([x.reshape(n, -1) for x in ins], dim=1).reshape(-1)
        if factor is not None:
            send.mul_(factor)
        mine = self._reduce_scatter(send, name)
        offset = 0
        for o in outs:
            o.copy_(mine[offset:offset + o.numel()].view(o.shape))
            offset += o.numel()
        return completed(list(outputs), outs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all-to-all, gather, scatter ----------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> dist.Work:
        """``dist.all_to_all_single``: rows of ``input`` to each rank, uneven splits allowed.

        Args:
            output: [sum(output_split_sizes), *rest], input's dtype: rows from rank 0, 1, ...
            input: [sum(input_split_sizes), *rest]; rest and dtype the same on every rank.
            output_split_sizes: [size] rows from each rank ([] : output.shape[0] / size each).
            input_split_sizes: [size] rows to each rank ([] : input.shape[0] / size each).

        Returns:
            A finished Work; its future holds [output]. Counts that disagree with the peers'
            raise ValueError on every rank.
        """
        out, inp = plain(output), plain(input)
        n = self.size()
        if inp.dim() == 0 or out.dim() == 0 or out.dtype != inp.dtype:
            self._reject(ValueError(f"all_to_all_single: rank {self._me()} passed input {tuple(inp.shape)} "
                                    f"{inp.dtype} and output {tuple(out.shape)} {out.dtype}; both need a row "
                                    "dimension and one dtype"), inp)
        send = list(input_split_sizes) if len(input_split_sizes) else None
        if len(output_split_sizes):
            recv = list(output_split_sizes)
        elif out.shape[0] % n == 0:
            recv = [out.shape[0] // n] * n
        else:
            self._reject(ValueError(f"all_to_all_single: rank {self._me()} has {out.shape[0]} output rows, not "
                                    f"divisible by the group size {n}; pass output_split_sizes"), inp)
        if inp.dtype in SUPPORTED_DTYPES:
            self.comm.all_to_all(inp, send, out=out, recv_counts=recv)
        else:
            # [rows, *rest, element bytes]: the split sizes stay rows (a 1-d wire view would count bytes)
            src = inp.contiguous().unsqueeze(-1).view(torch.uint8)

            def fill(dst: torch.Tensor) -> None:
                self.comm.all_to_all(src, send, out=dst.view(out.shape[0], *src.shape[1:]), recv_counts=recv)

            self._written(out, fill)
        return completed([output], [out])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """``dist.all_to_all``: ``input_tensors[r]`` to rank r, ``output_tensors[r]`` from rank r.

        Args:
            output_tensors: [size] tensors of one dtype (sizes may differ).
            input_tensors: [size] tensors of that dtype.

        Returns:
            A finished Work; its future holds ``output_tensors``.
        """
        outs, ins = [plain(o) for o in output_tensors], [plain(x) for x in input_tensors]
        n = self.size()
        if len(outs) != n or len(ins) != n or len({t.dtype for t in outs + ins}) != 1:
            self._reject(ValueError(f"all_to_all: rank {self._me()} passed {len(ins)} inputs and {len(outs)} "
                                    f"outputs of dtypes {sorted({str(t.dtype) for t in outs + ins})}; need {n} "
                                    "of each, one dtype"), ins[0] if ins else None)
        flat = [wire(flat_view(x)) for x in ins]
        recv = [wire_count(o) for o in outs]
        got = self.comm.all_to_all(torch.cat(flat), [f.numel() for f in flat], recv_counts=recv)
        offset = 0
        for o, k in zip(outs, recv):
            o.copy_(unwire(got[offset:offset + k], o))
            offset += k
        return completed(list(output_tensors), outs)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None) -> dist.Work:
        """``dist.gather``: every rank's input into ``output_tensors[0]`` on the root only.

        Only the root receives data (an all-to-all in which every rank sends to the root alone).

        Args:
            output_tensors: on the root [1] list of [size] tensors (input's dtype); elsewhere [].
            input_tensors: [1] list of one tensor.
            opts: ``GatherOptions`` (``rootRank``).

        Returns:
            A finished Work; its future holds ``output_tensors``.
        """
        root = option(opts, "rootRank", 0)
        x = self._one(input_tensors, "gather")
        n, me = self.size(), self.rank()
        outs = [plain(o) for o in output_tensors[0]] if me == root and output_tensors else []
        if me == root and (len(outs) != n or any(o.dtype != x.dtype for o in outs)):
            self._reject(ValueError(f"gather: the root, rank {self._me()}, passed {len(outs)} output tensors; "
                                    f"need {n} of the input's dtype {x.dtype}"), x)
        src = wire(flat_view(x))
        send = [0] * n
        send[root] = src.numel()
        recv = [wire_count(o) for o in outs] if me == root else [0] * n
        got = self.comm.all_to_all(src, send, recv_counts=recv)
        offset = 0
        for o, k in zip(outs, recv):
            o.copy_(unwire(got[offset:offset + k], o))
            offset += k
        return completed(output_tensors, outs)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None) -> dist.Work:
        """``dist.scatter``: the root's ``input_tensors[0][r]`` into rank r's output.

        Args:
            output_tensors: [1] list of one tensor.
            input_tensors: on the root [1] list of [size] tensors (output's dtype); elsewhere [].
            opts: ``ScatterOptions`` (``rootRank``).

        Returns:
            A finished Work; its future holds ``output_tensors``.
        """
        root = option(opts, "rootRank", 0)
        y = self._one(output_tensors, "scatter")
        n, me = self.size(), self.rank()
        recv = [0] * n
        recv[root] = wire_count(y)
        if me == root:
            xs = [plain(x) for x in input_tensors[0]] if input_tensors else []
            if len(xs) != n or any(x.dtype != y.dtype for x in xs):
                self._reject(ValueError(f"scatter: the root, rank {self._me()}, passed {len(xs)} input tensors; "
                                        f"need {n} of the output's dtype {y.dtype}"), y)
            flat = [wire(flat_view(x)) for x in xs]
            send, counts = torch.cat(flat), [f.numel() for f in flat]
        else:
            send, counts = wire(torch.empty(0, dtype=y.dtype, device=y.device)), [0] * n
        got = self.comm.all_to_all(send, counts, recv_counts=recv)
        y.copy_(unwire(got, y))
        return completed(output_tensors if isinstance(output_tensors, list) else [output_tensors], [y])
