"""Config(compile=True, joint_graph=False): each chunk's graph through torch.compile (inductor), exact against the
unmodified model over gloo, collectives included, and seen whole: dynamo traces f, g and the gathers as the c10d
functional ops (their backward too), with no graph break, at t=2 with sequence parallelism and at (p, t) = (2, 2).
The rank timeout bounds the compile time. compile=True alone takes the joint programs (tests/test_joint_graph.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tests import models
from tests.harness import module_pool
from tests.models import sgd_gaps, step_gaps


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


pool2 = module_pool(2, timeout_s=240.0)


def _tensor_parallel_gaps(sequence_parallel: bool):
    """t=2, compiled: forward and parameter gaps after SGD, this rank's share, what runs each chunk, and dynamo's
    graph breaks and graphs in this process (one rank per process: dynamo is not shared between threads)."""
    import fxpar
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, args, kwargs = models.build("gpt")
    reference = copy.deepcopy(model)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs,
                           config=fxpar.Config(compile=True, joint_graph=False,
                                               sequence_parallel=sequence_parallel))
    compiled = [type(c).__name__ for c in pm.compiled.callables.values()]
    share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
    return (*sgd_gaps(pm, reference, args, kwargs), share, compiled, _graph_breaks(),
            counters["stats"]["unique_graphs"])


@pytest.mark.gloo
@pytest.mark.slow
def test_compiled_sequence_parallel_gpt_is_exact_and_whole(pool2):
    """t=2 with sequence parallelism: f, g, the gathers and the reduce-scatters in one graph (plain t=2 stages are
    compiled in the pipeline below)."""
    for fwd, params, share, compiled, breaks, graphs in pool2.run(_tensor_parallel_gaps, True):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.6 and compiled == ["OptimizedModule"], (share, compiled)
        # one graph, its collectives in it (f and g forward and backward, the vocabulary's all-reduces)
        assert breaks == 0 and graphs == 1, (breaks, graphs)


pool4 = module_pool(4, timeout_s=240.0)


def _pipeline_gaps(steps: int = 2) -> tuple[float, float, int]:
    """(p, t) = (2, 2), 1F1B over 4 microbatches, compiled: the largest loss and parameter differences from the
    single-process model after `steps` SGD steps, and this rank's graph breaks."""
    import fxpar
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, _, _ = models.build("gpt")
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (8, 8), generator=g)
    target = torch.randint(0, 64, (8, 8), generator=g)

    def loss_fn(logits, t):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))

    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2, pp=2), example_args=(ids[:2],), loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=4, schedule="1f1b", compile=True, joint_graph=False))
    return (*step_gaps(pm, reference, ids, target, loss_fn, steps), _graph_breaks())


@pytest.mark.gloo
@pytest.mark.slow
def test_compiled_pipeline_of_tensor_parallel_stages_is_exact_and_whole(pool4):
    for loss_gap, param_gap, breaks in pool4.run(_pipeline_gaps):
        assert loss_gap <= 1e-5 and param_gap <= 1e-5, (loss_gap, param_gap)
        assert breaks == 0, breaks
