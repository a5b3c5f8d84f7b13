"""Where a sharded dim lands when a tensor is viewed with a new shape.

A view regroups dims without moving data. We cut both shapes into the smallest aligned groups (runs of dims whose
products match) and, inside the group holding the sharded dim, flatten it to three factors [L, S, R]: L outer
elements, the sharded S (its parts), and R inner elements. The shard lands on output dim j if the outer product of the
group's earlier output dims divides L, and either
    (a) dim j holds all of S: o_j = pre' * S * post'   (e.g. [b, s, h] -> [b*s, h], or [3*E] -> [3, E] with pre)
    (b) dim j holds the leading factor of S, which t divides: o_j = pre' * S_j, S = S_j * S_rest
        (e.g. [b, s, h] -> [b, s, nh, hd]: the heads take the shard, the head dim stays whole).
Anything else moved elements between shards, and we refuse (as tinygrad's reshape_multi does).
"""
from __future__ import annotations

import math

from fxpar.passes.ir.placements import Shard


class ReshapeError(Exception):
    pass


def _groups(in_shape, out_shape):
    """Aligned groups: list of (in_dims, out_dims) whose sizes have equal products."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(in_shape):
            pi, i = in_shape[i], i + 1
            gi.append(i - 1)
        if j < len(out_shape):
            pj, j = out_shape[j], j + 1
            gj.append(j - 1)
        while pi != pj:
            if pi < pj:
                pi, i = pi * in_shape[i], i + 1
                gi.append(i - 1)
            else:
                pj, j = pj * out_shape[j], j + 1
                gj.append(j - 1)
        groups.append((gi, gj))
    return groups


def reshape_shard(in_shape, out_shape, shard: Shard, t: int) -> Shard:
    """The output placement of viewing a tensor sharded as `shard` from in_shape to out_shape."""
    in_shape, out_shape = list(in_shape), list(out_shape)
    for gi, gj in _groups(in_shape, out_shape):
        if shard.dim in gi:
            break
    else:  # pragma: no cover - the sharded dim is always in some group
        raise ReshapeError("sharded dim not found")
    d = shard.dim
    left = math.prod(in_shape[k] for k in gi if k < d) * shard.pre
    right = shard.post * math.prod(in_shape[k] for k in gi if k > d)
    s = sum(shard.parts)
    before = 1
    for j in gj:
        o = out_shape[j]
        if left % before == 0:
            pre = left // before
            if o % (pre * s) == 0 and right % (o // (pre * s)) == 0:  # (a) all of S in dim j
                return Shard(j, shard.parts, pre, o // (pre * s))
            if len(shard.parts) == 1 and o % pre == 0:  # (b) leading factor of S in dim j
                s_j = o // pre
                if s_j > 1 and s % s_j == 0 and s_j % t == 0 and s_j < s:
                    return Shard(j, (s_j,), pre, 1)
        before *= o
        if before > left:
            break
    raise ReshapeError(
        f"view {tuple(in_shape)} -> {tuple(out_shape)} would move elements between the {t} shards of dim {d} ({shard})"
    )
