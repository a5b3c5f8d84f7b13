"""fxpar: Megatron-style parallelism for unmodified PyTorch Transformers, as torch.fx passes.

    mesh = fxpar.init_mesh(tp=2)
    pm = fxpar.parallelize(model, mesh, example_args=(ids,))
    fxpar.verify(model, pm, (ids,))
"""
from fxpar.api import parallelize
from fxpar.config import Config
from fxpar.mesh import init_mesh
from fxpar.verify import VerifyError, verify

__all__ = ["Config", "init_mesh", "parallelize", "verify", "VerifyError"]
