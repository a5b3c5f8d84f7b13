"""Config(compile=True): each chunk's graph through torch.compile (inductor), exact against the unmodified model at
t=2 over gloo, collectives included. The rank timeout bounds the compile time."""
import copy

import pytest

from tests import models
from tests.models import sgd_gaps
from tests.threaded import Threaded, on_ranks


@pytest.mark.gloo
@pytest.mark.slow
def test_compiled_tensor_parallel_gpt_is_exact():
    import fxpar
    from fxpar.api import build
    from fxpar.runtime.executable import tp_comm
    from fxpar.trace import trace

    model, args, kwargs = models.build("gpt")
    traced = trace(model, args, kwargs)
    copies = [copy.deepcopy(model) for _ in range(2)]

    def rank(r):
        reference = copy.deepcopy(copies[r])
        mesh = fxpar.init_mesh(tp=2)
        pm = build(copies[r], tp_comm(mesh), args, kwargs, mesh, traced=traced, config=fxpar.Config(compile=True))
        compiled = [type(c).__name__ for c in pm.compiled.callables.values()]
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, args, kwargs), share, compiled)

    with Threaded():
        results = on_ranks(rank, 2, 300.0)
    for got in results.values():
        assert isinstance(got[0], float), got  # a rank that raised returns its traceback
        fwd, params, share, compiled = got
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.6 and compiled == ["OptimizedModule"], (share, compiled)
