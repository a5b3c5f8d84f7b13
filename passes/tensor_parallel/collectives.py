"""The ops that the tensor-parallel pass inserts: Megatron's f and g, gather and scatter, the vocab embedding.

Each is an nn.Module so that the rewritten graph calls it as `self.tp_g_0(x)`: the module holds the explicit
communication context (process group, rank, size); there is no global state. Collectives go through
torch.distributed, so torch's CommDebugMode counts them. On fake or meta tensors (shape propagation) they move no
data: the result has the shape the real collective would give. The call nodes are tagged with their kind
(meta[FXPAR_COMM], passes/ir/meta.py), which is how every later pass recognises them.

    f        identity forward, all-reduce backward   (enters a region: the input's gradient is a per-rank partial)
    g        all-reduce forward, identity backward   (leaves a region: sums the row-parallel partial outputs)
    gather   all-gather forward, local block backward (LM head logits)
    scatter  local block forward, all-gather backward (a replicated operand that a region needs one block of)

Under sequence parallelism (passes/tensor_parallel/sequence_parallel.py) f and g split into their halves along the
sequence (Korthikanti et al. 2022, Sec. 4.2.2): an all-reduce is a reduce-scatter then an all-gather, so the bytes
on the wire are those of tensor parallelism.

    seq_gather          all-gather along the sequence forward, reduce-scatter backward   (f, entering a region)
    seq_reduce_scatter  reduce-scatter along the sequence forward, all-gather backward   (g, leaving a region)
    seq_gather_linear   seq_gather and the GEMMs that read it, as one op that saves this rank's block for backward
                        and gathers it again there, not the whole sequence (Korthikanti et al. 2022, Sec. 4.2.2)
[Note: collectives in a compiled graph]
    Under Config(compile=True) dynamo traces each chunk whole, and under Config(joint_graph=True) AOT autograd traces
    its forward and backward into one graph (passes/joint/export.py): the autograd Functions above, forward and
    backward. While either traces (`in_graph()`), every collective is called as the c10d functional op itself
    (`_c10d_functional.all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`, each with its
    `wait_tensor`), named by the group's name, so it is a node of the graph that passes and inductor can count and
    move; a simulated rank's graph names SIMULATED_GROUP, which never runs. Nothing else may stop the trace: no
    branch on a tensor's value (the vocabulary's id check asserts asynchronously instead) and no in-place
    all-reduce (`mark_dirty`). tests/test_compile.py counts the graph breaks: 0.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fxpar.passes.ir.placements import Shard, local_shard, unshard


@dataclass
class TPComm:
    """Who this rank is in its tensor-parallel group. group=None simulates the rank (shapes only, no numerics)."""

    rank: int
    size: int
    group: object = None

    @property
    def simulated(self) -> bool:
        return self.group is None and self.size > 1

    def __post_init__(self):
        # what a functional collective names: a simulated rank's graph names a group that never runs
        self.group_name = SIMULATED_GROUP if self.group is None else self.group.group_name

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size == 1:
            return x
        if in_graph():  # [Note: collectives in a compiled graph]
            return _wait(_c10d.all_reduce(x.contiguous(), op, self.group_name))
        if self.simulated or _shape_only(x):
            return x
        x = x.contiguous()
        dist.all_reduce(x, op=_OPS[op], group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [x]
        if in_graph():
            return list(_wait(_c10d.all_gather_into_tensor(x.contiguous().unsqueeze(0), self.size, self.group_name))
                        .unbind(0))
        if self.simulated or _shape_only(x):
            return [x] * self.size
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x, group=self.group)
        return out

    def gather(self, x: torch.Tensor, spec: Shard) -> torch.Tensor:
        """The whole tensor from every rank's block of it, laid out as `spec`."""
        return x if self.size == 1 else unshard(self.all_gather(x), spec)

    def reduce_scatter(self, x: torch.Tensor, spec: Shard) -> torch.Tensor:
        """This rank's block (laid out as `spec`) of the sum over the ranks of x."""
        if self.size == 1:
            return x
        blocks = [local_shard(x, spec, r, self.size) for r in range(self.size)]
        if in_graph():
            return _wait(_c10d.reduce_scatter_tensor(torch.stack(blocks), "sum", self.size, self.group_name))[0]
        if self.simulated or _shape_only(x):
            return blocks[self.rank]
        out = torch.empty_like(blocks[self.rank])
        dist.reduce_scatter(out, blocks, group=self.group)
        return out


_c10d = torch.ops._c10d_functional
_wait = _c10d.wait_tensor
SIMULATED_GROUP = "fxpar-simulated-tp"  # a group name for a simulated rank's graph: traced, never run
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_JOINT = contextvars.ContextVar("fxpar_joint_trace", default=False)


@contextlib.contextmanager
def functional_collectives():
    """While the joint graph is traced (passes/joint/export.py): every collective is a c10d functional op, a node
    of the traced graph, on fake tensors too."""
    token = _JOINT.set(True)
    try:
        yield
    finally:
        _JOINT.reset(token)


def in_graph() -> bool:
    """The collectives are being traced into a graph (dynamo's or the joint graph's), not run."""
    return torch.compiler.is_compiling() or _JOINT.get()  # dynamo cannot trace ContextVar.get: ask it first


def _shape_only(x: torch.Tensor) -> bool:
    """A fake or meta tensor: only its shape is computed, so a collective on it moves nothing."""
    return isinstance(x, FakeTensor) or x.device.type == "meta"


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, in_place=False):
        ctx.comm, ctx.in_place = comm, in_place
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad if ctx.in_place or in_graph() else grad.clone()), None, None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, in_place=False):
        if in_place and not in_graph() and x.is_contiguous() and not x._is_view():
            # a view: a hook's wrapper (CommDebugMode's); compiled, inductor reuses buffers itself
            ctx.mark_dirty(x)  # the output is x itself, reduced: later in-place ops on it are ordinary ones
            return comm.all_reduce(x)
        return comm.all_reduce(x if in_graph() else x.clone())  # a functional all-reduce copies itself

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, spec):
        ctx.comm, ctx.spec = comm, spec
        return local_shard(x, spec, comm.rank, comm.size)

    @staticmethod
    def backward(ctx, grad):
        return unshard(ctx.comm.all_gather(grad), ctx.spec), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, spec):
        ctx.comm, ctx.spec = comm, spec
        return unshard(comm.all_gather(x), spec)

    @staticmethod
    def backward(ctx, grad):
        return local_shard(grad, ctx.spec, ctx.comm.rank, ctx.comm.size), None, None


class _SeqGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, spec):
        ctx.comm, ctx.spec = comm, spec
        return comm.gather(x, spec)

    @staticmethod
    def backward(ctx, grad):  # each rank's gradient of the whole sequence is a partial sum (its heads' share)
        return ctx.comm.reduce_scatter(grad, ctx.spec), None, None


class _SeqReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, spec):
        ctx.comm, ctx.spec = comm, spec
        return comm.reduce_scatter(x, spec)

    @staticmethod
    def backward(ctx, grad):  # every rank's partial input reads the whole sum: its gradient is the whole gradient
        return ctx.comm.gather(grad, ctx.spec), None, None


class _SeqGatherLinear(torch.autograd.Function):
    """The GEMMs of all_gather(x) (its rows flattened to 2-D first where `flat`): per GEMM i, `kinds[i]` is "linear"
    (y = x w^T + b, w [out, in]) or "mm" (y = x w + b, w [in, out], as addmm / mm). Saves x (the block) and the
    weights. The math is the ops' own in the GEMMs' compute dtype: dx = sum_i g_i w_i^T (or w_i), dw_i, db_i."""

    @staticmethod
    def forward(ctx, x, comm, spec, flat, kinds, *weights):
        ctx.comm, ctx.spec, ctx.flat, ctx.kinds = comm, spec, flat, kinds
        rows = _rows(comm.gather(x, spec), flat)
        outs = tuple(torch.nn.functional.linear(rows, w, b) if kind == "linear" else
                     (rows @ w if b is None else torch.addmm(b, rows, w))
                     for kind, w, b in zip(kinds, weights[::2], weights[1::2]))
        ctx.save_for_backward(x, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = ctx.comm.gather(x, ctx.spec)
        rows = _rows(full, ctx.flat)
        dx, dweights = None, []
        for g, kind, w, b in zip(grads, ctx.kinds, weights[::2], weights[1::2]):
            if g is None:
                dweights += [None, None]
                continue
            g2, inputs = g.reshape(-1, g.shape[-1]), rows.reshape(-1, rows.shape[-1]).to(g.dtype)
            linear = kind == "linear"
            part = g @ (w if linear else w.t()).to(g.dtype)
            dx = part if dx is None else dx + part
            dw = g2.t() @ inputs if linear else inputs.t() @ g2
            dweights += [dw.to(w.dtype), None if b is None else g2.sum(0).to(b.dtype)]
        dx = torch.zeros_like(full) if dx is None else dx.to(full.dtype).reshape(full.shape)
        return (ctx.comm.reduce_scatter(dx, ctx.spec), None, None, None, None, *dweights)


def _rows(full: torch.Tensor, flat: bool) -> torch.Tensor:
    return full.reshape(-1, full.shape[-1]) if flat else full


class _FMany(torch.autograd.Function):
    """f of several tensors: identity forward; backward all-reduces their gradients as one flat tensor."""

    @staticmethod
    def forward(ctx, comm, *xs):
        ctx.comm, ctx.shapes = comm, [x.shape for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        like = next(g for g in grads if g is not None)
        flat = torch.cat([(g if g is not None else like.new_zeros(s)).reshape(-1).to(like.dtype)
                          for g, s in zip(grads, ctx.shapes)])
        flat = ctx.comm.all_reduce(flat)
        return (None, *(p.view(s).to(g.dtype if g is not None else p.dtype) for p, s, g in
                        zip(flat.split([math.prod(s) for s in ctx.shapes]), ctx.shapes, grads)))


class _TPModule(nn.Module):
    """A module that holds its rank's communication context; the graph calls it like an op. `in_place`: the
    all-reduce may write into the tensor it is given (passes/tensor_parallel/in_place.py proved nothing else reads
    it)."""

    def __init__(self, comm: TPComm):
        super().__init__()
        self.comm, self.in_place = comm, False


class CopyToTP(_TPModule):
    """f: enters a tensor-parallel region."""

    def forward(self, x):
        return _F.apply(x, self.comm, self.in_place)


class ReduceFromTP(_TPModule):
    """g: leaves a tensor-parallel region by summing the partial outputs of a row-parallel GEMM."""

    def forward(self, x):
        return _G.apply(x, self.comm, self.in_place)


class ScatterToTP(_TPModule):
    """This rank's block of a replicated tensor, laid out like Shard(dim, parts, pre, post)."""

    def forward(self, x, dim: int, parts: tuple, pre: int = 1, post: int = 1):
        return _Scatter.apply(x, self.comm, Shard(dim, tuple(parts), pre, post))


class GatherFromTP(_TPModule):
    """The full tensor from every rank's block along `dim` (the LM head's logits); `parts`, `pre`, `post`: a block
    laid out as Shard(dim, parts, pre, post) (a sequence block of rows flattened to 2-D)."""

    def forward(self, x, dim: int, parts: tuple | None = None, pre: int = 1, post: int = 1):
        dim = dim % x.dim()
        return _Gather.apply(x, self.comm, Shard(dim, tuple(parts or (x.shape[dim] * self.comm.size,)), pre, post))


class GatherSequence(_TPModule):
    """seq_gather: f under sequence parallelism; the sequence blocks of every rank, whole, into a region."""

    def forward(self, x, dim: int, parts: tuple, pre: int = 1, post: int = 1):
        return _SeqGather.apply(x, self.comm, Shard(dim, tuple(parts), pre, post))


class ReduceScatterSequence(_TPModule):
    """seq_reduce_scatter: g under sequence parallelism; the sum of the partial outputs, this rank's sequence block."""

    def forward(self, x, dim: int, parts: tuple, pre: int = 1, post: int = 1):
        return _SeqReduceScatter.apply(x, self.comm, Shard(dim, tuple(parts), pre, post))


class GatherSequenceLinear(_TPModule):
    """seq_gather_linear: the sequence blocks gathered into GEMMs (`weights`: weight, bias-or-None per GEMM; `kinds`:
    "linear" or "mm" per GEMM; `flat`: the GEMMs read the gathered rows flattened to 2-D); returns their outputs."""

    def forward(self, x, weights: list, kinds: tuple, dim: int, parts: tuple, pre: int = 1, post: int = 1,
                flat: bool = False):
        return _SeqGatherLinear.apply(x, self.comm, Shard(dim, tuple(parts), pre, post), flat, tuple(kinds), *weights)


class CopyManyToTP(_TPModule):
    """seq_weights: f of the weights one layer reads on sequence blocks; returns them (a tuple)."""

    def forward(self, *weights):
        return _FMany.apply(self.comm, *weights)


class VocabParallelEmbedding(_TPModule):
    """Look up the ids in this rank's rows of the vocabulary, zero the rest, and all-reduce (g)."""

    def forward(self, weight, ids, *rest):
        return _G.apply(self.lookup(weight, ids, *rest), self.comm)

    def lookup(self, weight, ids, *rest):
        """This rank's rows' share of the embedding: the rows of its ids, zeros for the ids of other ranks."""
        rows = weight.shape[0]
        _check_ids(ids, rows * self.comm.size)
        start = self.comm.rank * rows
        outside = (ids < start) | (ids >= start + rows)
        local = (ids - start).masked_fill(outside, 0)
        pad = rest[0] if rest else -1  # aten.embedding's padding_idx only masks the gradient of that row
        pad = pad - start if start <= pad < start + rows else -1
        return torch.ops.aten.embedding(weight, local, pad).masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelEmbeddingSequence(VocabParallelEmbedding):
    """The vocab-parallel lookup under sequence parallelism: reduce-scattered along the sequence, not all-reduced."""

    def forward(self, weight, ids, *rest, dim: int, parts: tuple, pre: int = 1, post: int = 1):
        return _SeqReduceScatter.apply(self.lookup(weight, ids, *rest), self.comm, Shard(dim, tuple(parts), pre, post))


def _check_ids(ids: torch.Tensor, vocab: int, what: str = "token id") -> None:
    """Raise as aten.embedding (or the loss) does for an id outside [0, vocab): each rank would see it as another
    rank's row and the all-reduce would silently return zeros. On an accelerator the check is asynchronous."""
    if _shape_only(ids) and not in_graph():
        return
    bad = (ids < 0) | (ids >= vocab)
    if ids.device.type != "cpu" or in_graph():  # no branch on data in a compiled graph
        torch._assert_async(~bad.any(), f"fxpar: a {what} is outside the vocabulary [0, {vocab})")
    elif bad.any():
        raise IndexError(f"fxpar: {what} {int(ids[bad][0])} is out of range for the vocabulary of {vocab} "
                         "(index out of range, as the unparallelized op would say)")
