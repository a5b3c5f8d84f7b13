"""A model whose state-dict hooks rename its keys (a fused wqkv saved as wq, wk, wv): sharded and exact, and its own
spelling honoured by full_state_dict, load_state_dict and checkpoints ([Note: state-dict hooks] in
fxpar/runtime/weights.py)."""
import pytest
import torch
import torch.nn as nn

from fxpar.runtime.weights import tensor_keys
from tests.models import Stack, sgd_gaps
from tests.harness import module_pool
from tests.threaded import on_tp_ranks

pool2 = module_pool(2)

H, HEADS = 16, 4


class SplitOnSave(nn.Module):
    """Attention with one fused wqkv, saved as wq/wk/wv (and fused again on load), its heads unbound ViT-style."""

    def __init__(self):
        super().__init__()
        self.norm, self.wqkv, self.wo = nn.LayerNorm(H), nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H)
        self._register_state_dict_hook(SplitOnSave._save)
        self._register_load_state_dict_pre_hook(SplitOnSave._load)

    @staticmethod
    def _save(module, state, prefix, local_metadata):
        for name, part in zip(("wq", "wk", "wv"), state.pop(prefix + "wqkv.weight").chunk(3)):
            state[f"{prefix}{name}.weight"] = part
        return state

    @staticmethod
    def _load(state, prefix, *args):
        if prefix + "wq.weight" in state:
            state[prefix + "wqkv.weight"] = torch.cat([state.pop(f"{prefix}{n}.weight") for n in ("wq", "wk", "wv")])

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.norm(x)).reshape(b, t, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.wo(o.transpose(1, 2).reshape(b, t, H))


def Model() -> Stack:
    return Stack(SplitOnSave)


def test_tensor_keys_are_the_state_dict_without_its_hooks():
    model = Model()
    assert "layers.0.wq.weight" in model.state_dict() and "layers.0.wqkv.weight" not in model.state_dict()
    assert tensor_keys(model) == [f"layers.{i}.{k}" for i in range(2)
                                  for k in ("norm.weight", "norm.bias", "wqkv.weight", "wo.weight", "wo.bias")]


@pytest.mark.gloo
def test_renamed_keys_are_sharded_exact_and_spoken_back(tmp_path):
    import fxpar

    torch.manual_seed(0)
    x, model, other = torch.randn(2, 5, H), Model(), Model()  # other: weights to load, in the model's spelling

    def per_rank(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        fwd, params = sgd_gaps(pm, reference, (x,))
        full, want = pm.full_state_dict(), reference.state_dict()
        spelled = list(full) == list(want) and all(torch.allclose(full[k], want[k], atol=1e-6) for k in want)
        fxpar.save(str(tmp_path / "ck"), pm)
        pm.load_state_dict(other.state_dict())  # its load pre-hooks fuse wq/wk/wv again
        reloaded = (pm(x) - other(x)).abs().max().item()
        fxpar.load(str(tmp_path / "ck"), pm)  # back to the trained weights, from the checkpoint
        resumed = (pm(x) - reference(x)).abs().max().item()
        return fwd, params, share, spelled, reloaded, resumed

    for fwd, params, share, spelled, reloaded, resumed in on_tp_ranks(model, (x,), per_rank):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.55, share  # wqkv split by heads (q | k | v), wo by rows
        assert spelled, "full_state_dict is not model.state_dict()'s spelling"
        assert reloaded <= 1e-5 and resumed <= 1e-5, (reloaded, resumed)



def _pipelined():
    """Loss of one pp=2 step against the unmodified model's, and full_state_dict's keys against its own."""
    import fxpar

    torch.manual_seed(0)
    x, target, model = torch.randn(4, 5, H), torch.randn(4, 5, H), Model()

    def loss_fn(out, tgt):
        return ((out - tgt) ** 2).mean()

    want = loss_fn(model(x), target).item()
    keys = list(model.state_dict())
    pm = fxpar.parallelize(model, fxpar.init_mesh(pp=2), example_args=(x[:2],), loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=2))
    return abs(pm.step(x, target=target).item() - want), list(pm.full_state_dict()) == keys


@pytest.mark.gloo
def test_renamed_keys_across_pipeline_stages(pool2):
    for loss_err, spelled in pool2.run(_pipelined):
        assert loss_err <= 1e-5 and spelled, (loss_err, spelled)
