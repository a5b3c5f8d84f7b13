"""fxpar.save / fxpar.load: sharded DCP checkpoints under the original keys and full shapes.

Resume: train n steps straight; separately train k, save, build a fresh model (other weights), parallelize it at
another layout, load, train n - k: the losses of steps k+1..n equal the straight run's (bitwise at the same layout;
across a reshard, in float64, within 1e-10), with AdamW's state. Float64 across a reshard: two layouts sum in two
orders, and AdamW's first step, lr * g / (|g| + eps), has slope lr / eps at g = 0, which turns the last bit of a
near-zero gradient into 1e-5 of a weight in fp32, a bit each CPU rounds its own way (tests/test_zero.py).
Crash safety: a rank SIGKILLed mid-save leaves the previous checkpoint loadable and the partial one refused; damaged
and mismatched checkpoints are refused naming what is wrong.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal

import pytest
import torch

from tests import models
from tests.harness import RankFailure, module_pool
from tests.models import float64_stays

pool1 = module_pool(1)
pool2 = module_pool(2)
pool4 = module_pool(4)
RESHARD_TOL = models.FLOAT64_TOL  # float64: see the module docstring
BATCH, STEPS, SAVED_AT = 4, 4, 2


def _loss(out, target):
    return torch.nn.functional.cross_entropy(models.first_tensor(out).flatten(0, 1), target.flatten())


def _batches(args):
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, models.VOCAB, (BATCH, args[0].shape[1]), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, 1)) for x in ids]


def _precision(wide):
    """Around a run whose model is in float64 (wide): `Tensor.float()` keeps float64."""
    return float64_stays() if wide else contextlib.nullcontext()


def _parallel(name, layout, fresh=False, wide=False):
    """wide: the model in float64 (inside _precision(True))."""
    import fxpar

    p, t, d, v, zero, mp = layout
    model, args, kwargs = models.build(name)
    if wide:
        model.double()
    if fresh:  # other weights: loading must overwrite every one of them
        with torch.no_grad():
            for w in model.parameters():
                w.add_(torch.randn_like(w))
    m = 2  # a multiple of p = 2 for the interleaved schedule too
    args = (_batches(args)[0][0][:BATCH // (d * m)],)  # one microbatch
    precision = fxpar.MixedPrecision(param_dtype=torch.bfloat16) if mp else None
    config = fxpar.Config(microbatches=m, virtual_stages=v, zero=zero, mixed_precision=precision,
                          schedule="interleaved-1f1b" if v > 1 else "1f1b")
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=args, example_kwargs=kwargs,
                           loss_fn=_loss, config=config)
    return pm, pm.optimizer(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1), args, kwargs


def _train(pm, opt, batches, kwargs) -> list[float]:
    losses = []
    for ids, target in batches:
        opt.zero_grad()
        losses.append(pm.step(ids, target=target, **kwargs).item())
        opt.step()
    return losses


def _straight(name, layout, wide=False) -> list[float]:
    """The losses of STEPS steps, uninterrupted."""
    with _precision(wide):
        pm, opt, args, kwargs = _parallel(name, layout, wide=wide)
        return _train(pm, opt, _batches(args), kwargs)


def _save(name, path, layout, wide=False) -> None:
    """SAVED_AT steps, then a checkpoint."""
    import fxpar

    with _precision(wide):
        pm, opt, args, kwargs = _parallel(name, layout, wide=wide)
        _train(pm, opt, _batches(args)[:SAVED_AT], kwargs)
        fxpar.save(path, pm, optimizer=opt, extra={"step": SAVED_AT})


def _resume(name, path, layout, wide=False) -> list[float]:
    """A fresh model (other weights) at `layout`, loaded from `path`, trained on from the saved step."""
    import fxpar

    with _precision(wide):
        pm, opt, args, kwargs = _parallel(name, layout, fresh=True, wide=wide)
        extra = fxpar.load(path, pm, optimizer=opt)
        return _train(pm, opt, _batches(args)[extra["step"]:], kwargs)


def _layout(p=1, t=1, d=1, v=1, zero=0, mp=False):
    return (p, t, d, v, zero, mp)


POOLS = {1: "pool1", 2: "pool2", 4: "pool4"}


def _run(request, layout, fn, *args):
    """fn on the pool whose size is the layout's p * t * d (fresh processes for each layout's pool)."""
    pool = request.getfixturevalue(POOLS[layout[0] * layout[1] * layout[2]])
    return pool.run(fn, *args)


_STRAIGHT: dict = {}  # (name, layout, wide) -> the uninterrupted run's losses, computed once per module


def _check_resume(request, tmp_path, name, before, after):
    path = str(tmp_path / "ckpt")
    wide = before != after  # float64 across a reshard (the module docstring)
    if (name, before, wide) not in _STRAIGHT:
        _STRAIGHT[name, before, wide] = _run(request, before, _straight, name, before, wide)[0][SAVED_AT:]
    straight = _STRAIGHT[name, before, wide]
    _run(request, before, _save, name, path, before, wide)
    for resumed in _run(request, after, _resume, name, path, after, wide):
        gap = max(abs(a - b) for a, b in zip(straight, resumed))
        if before == after:
            assert resumed == straight, (straight, resumed)  # bitwise
        else:
            assert gap <= RESHARD_TOL, (straight, resumed)
        print(f"{name} {before} -> {after}: loss gap {gap:.2e}")


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_resume_at_the_same_layout_is_bitwise(request, tmp_path, name):
    _check_resume(request, tmp_path, name, _layout(t=2), _layout(t=2))


@pytest.mark.parametrize("name,before,after", [
    ("gpt", _layout(p=2, t=2), _layout(t=2, d=2)), ("llama", _layout(t=2, d=2), _layout(p=2, t=2)),
    ("gpt", _layout(p=2, t=2), _layout(p=2, d=2)), ("llama", _layout(p=2, d=2), _layout(p=2, t=2)),
    ("gpt", _layout(p=2, t=2), _layout()), ("llama", _layout(), _layout(p=2, t=2))])
def test_resume_across_pipeline_tensor_and_data_parallel(request, tmp_path, name, before, after):
    """Saved at (p, t, d) = (2, 2, 1), loaded at (1, 2, 2), (2, 1, 2) and (1, 1, 1) (the example GPT), and the
    reverse (a Hugging Face Llama)."""
    _check_resume(request, tmp_path, name, before, after)


@pytest.mark.parametrize("before,after", [
    (_layout(p=2, d=2, v=2), _layout(p=2, t=2)),  # interleaved v=2 saved, loaded at v=1
    (_layout(d=2, zero=1), _layout(t=2)), (_layout(t=2), _layout(d=2, zero=1)),  # the distributed optimizer
    (_layout(t=2, mp=True), _layout(t=2, mp=True))])  # bf16 weights and fp32 main parameters, bitwise
def test_resume_interleaved_zero_and_mixed_precision(request, tmp_path, before, after):
    _check_resume(request, tmp_path, "gpt5" if before[3] > 1 else "llama", before, after)


def test_bf16_resume_across_layouts_keeps_the_fp32_main_parameters(request, tmp_path):
    """bf16 at t=2 saved, loaded at d=2 with the distributed optimizer: the run goes on within the recipe's own
    layout-to-layout rounding (2e-3 relative, as in tests/test_mixed_precision.py), because the fp32 main
    parameters, not the bf16 weights, are restored."""
    before, after = _layout(t=2, mp=True), _layout(d=2, zero=1, mp=True)
    path = str(tmp_path / "ckpt")
    straight = _run(request, before, _straight, "llama", before)[0][SAVED_AT:]
    _run(request, before, _save, "llama", path, before)
    for resumed in _run(request, after, _resume, "llama", path, after):
        assert max(abs(a - b) / abs(a) for a, b in zip(straight, resumed)) <= 2e-3, (straight, resumed)


def _save_and_gather(name, path, layout) -> dict:
    """Save as _save does; return the full state dict (original keys, original layout) to compare with."""
    import fxpar

    pm, opt, args, kwargs = _parallel(name, layout)
    _train(pm, opt, _batches(args)[:1], kwargs)
    fxpar.save(path, pm, optimizer=opt, extra={"step": 1})
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_torch_reads_the_original_model_from_a_t2_checkpoint(pool2, tmp_path, name):
    """Plain torch.distributed.checkpoint, one process, no fxpar: the unmodified model's state_dict, every key and
    full shape, head-interleaved QKV back in its original layout (equal to full_state_dict bitwise)."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    full = pool2.run(_save_and_gather, name, path, _layout(t=2))[0]
    model, _, _ = models.build(name)
    state = {f"model/{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert set(state) == {f"model/{k}" for k in full}
    for k, v in full.items():
        assert torch.equal(state[f"model/{k}"], v), k


def _killed_mid_save(previous, path) -> None:
    """A complete save to `previous`, then a save to `path` during which rank 1 is SIGKILLed while writing."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as fs

    import fxpar

    pm, opt, args, kwargs = _parallel("gpt", _layout(t=2))
    _train(pm, opt, _batches(args)[:1], kwargs)
    fxpar.save(previous, pm, optimizer=opt, extra={"step": 1})
    _train(pm, opt, _batches(args)[1:2], kwargs)
    if dist.get_rank() == 1:
        def dying(transforms, stream, *rest):
            stream.write(b"\0" * 64)
            stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        fs._write_item = dying
    fxpar.save(path, pm, optimizer=opt, extra={"step": 2})


def _load_outcomes(paths) -> list[str]:
    """What fxpar.load says of each path: the extra it returns, or the error's type and message."""
    import fxpar

    out = []
    for path in paths:
        pm, opt, _, _ = _parallel("gpt", _layout(t=2), fresh=True)
        try:
            out.append(f"ok {fxpar.load(path, pm, optimizer=opt)}")
        except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(pool2, tmp_path):
    previous, path = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    with pytest.raises(RankFailure) as failure:
        pool2.run(_killed_mid_save, previous, path)
    assert "SIGKILL" in failure.value.failures[1], failure.value.failures
    assert 0 not in failure.value.failures or "fxpar.save: rank 0: the save into" in failure.value.failures[0]
    assert os.path.isdir(path + ".partial") and not os.path.exists(path)
    outcomes = pool2.run(_load_outcomes, [previous, path, path + ".partial"])  # fresh ranks
    for ok, gone, partial in outcomes:
        assert ok == "ok {'step': 1}", ok
        assert gone.startswith("FileNotFoundError: fxpar.load: no checkpoint at") and ".partial" in gone, gone
        assert partial.startswith("ValueError: fxpar.load:") and "fxpar.json is missing" in partial, partial


def test_damaged_mismatched_and_unsafe_checkpoints_are_refused(pool2, tmp_path):
    import json
    import shutil

    good = str(tmp_path / "good")
    pool2.run(_save, "gpt", good, _layout(t=2))
    data = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))
    truncated, missing, unsafe = (str(tmp_path / n) for n in ("truncated", "missing", "unsafe"))
    for copy in (truncated, missing, unsafe):
        shutil.copytree(good, copy)
    with open(os.path.join(truncated, data[0]), "r+b") as f:
        f.truncate(100)
    os.remove(os.path.join(missing, data[-1]))
    evil = pickle.dumps(_Evil())
    with open(os.path.join(unsafe, ".metadata"), "wb") as f:
        f.write(evil)
    manifest = json.load(open(os.path.join(unsafe, "fxpar.json")))
    manifest["files"][".metadata"] = len(evil)
    json.dump(manifest, open(os.path.join(unsafe, "fxpar.json"), "w"))
    other = str(tmp_path / "llama")
    pool2.run(_save, "llama", other, _layout(t=2))
    for t, m, u, o in pool2.run(_load_outcomes, [truncated, missing, unsafe, other]):
        assert f"is damaged: {data[0]} is 100 bytes" in t, t
        assert f"is damaged: {data[-1]} is missing" in m, m
        assert "UnpicklingError: fxpar: the checkpoint's .metadata names posix.system" in u or "os.system" in u, u
        assert o.startswith("ValueError: fxpar.load:") and "another model" in o, o
    assert not os.path.exists(tmp_path / "pwned")
    for message in pool2.run(_load_into_sgd, good):
        assert "holds a AdamW with 1 parameter groups; the optimizer given is a SGD" in message, message


def _load_into_sgd(path) -> str:
    import fxpar

    pm, _, _, _ = _parallel("gpt", _layout(t=2))
    try:
        fxpar.load(path, pm, optimizer=pm.optimizer(torch.optim.SGD, lr=0.1))
    except ValueError as e:
        return str(e)
    return "no error"


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_chunks_are_the_shard_in_the_full_tensor():
    """Every chunk of every rank's shard is the same slice of the full tensor (plain, head-interleaved QKV,
    gate|up, per-head [H, 3, hd] blocks, unequal parts), and together they tile it once."""
    from fxpar.checkpoint.chunks import chunks
    from fxpar.passes.ir.placements import Shard, local_shard

    for spec, t in [(Shard(0, (12,)), 2), (Shard(0, (8, 8, 8)), 4), (Shard(1, (6, 6)), 2), (Shard(0, (4,), pre=6), 2),
                    (Shard(0, (8, 4, 4)), 2), (Shard(1, (4, 2, 2), post=3), 2)]:
        shape = [5, 5]
        shape[spec.dim] = spec.size
        full = torch.arange(shape[0] * shape[1]).reshape(shape)
        covered = torch.zeros(spec.size, dtype=torch.long)
        for r in range(t):
            local = local_shard(full, spec, r, t)
            for local_start, global_start, n in chunks(tuple(shape), spec, r, t):
                assert torch.equal(local.narrow(spec.dim, local_start, n), full.narrow(spec.dim, global_start, n))
                covered[global_start:global_start + n] += 1
        assert covered.eq(1).all(), (spec, covered)


def test_whole_parts_are_the_same_chunk_on_every_rank():
    """[Note: whole parts]: the K and V rows every rank holds are one chunk at the same offsets on every rank (DCP
    keeps one copy); the query rows are tiled once."""
    from fxpar.checkpoint.chunks import chunks
    from fxpar.passes.ir.placements import Shard, local_shard

    spec, t = Shard(0, (8, 2, 2), whole=frozenset({1, 2})), 2
    full = torch.arange(12 * 3).reshape(12, 3)
    seen = []
    for r in range(t):
        local = local_shard(full, spec, r, t)
        assert local.shape == (8, 3)
        got = chunks((12, 3), spec, r, t)
        for local_start, global_start, n in got:
            assert torch.equal(local.narrow(0, local_start, n), full.narrow(0, global_start, n))
        seen.append(got)
    assert seen == [[(0, 0, 4), (4, 8, 4)], [(0, 4, 4), (4, 8, 4)]]  # k|v: one chunk, the same on both ranks


@pytest.mark.parametrize("before,after", [(_layout(t=2), _layout()), (_layout(), _layout(t=2))])
def test_resume_with_whole_parts(request, tmp_path, before, after):
    """One K/V head in a fused projection (StarCoder's multi-query attention), saved at t=2 and loaded at t=1, and
    the reverse."""
    _check_resume(request, tmp_path, "starcoder_mqa", before, after)


def _params_on_meta(model):
    """The model with its parameters (not its buffers) on the meta device, as loaders that build models empty do."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    return model


def _from_meta(name, path, layout) -> tuple[list[str], dict]:
    """A model built on the meta device, parallelized at `layout`: a step, a save and pm.optimizer are refused
    before it is loaded; then it is loaded."""
    import fxpar

    if name == "gpt":
        with torch.device("meta"):
            model, _, kwargs = models.build(name)
    else:
        model, _, kwargs = models.build(name)
        _params_on_meta(model)
    p, t, d, *_ = layout
    example, _ = _batches((torch.zeros(1, 8, dtype=torch.long),))[0]
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=(example[:BATCH // (2 * d)],),
                           example_kwargs=kwargs, loss_fn=_loss, config=fxpar.Config(microbatches=2))
    held = {k: (v.device.type, v.numel()) for k, v in pm.rank.weights.held().items()}
    assert all(device == "cpu" for device, _ in held.values()), held
    refused = []
    for attempt in (lambda: pm.step(example, target=example, **kwargs), lambda: fxpar.save(path + "-x", pm),
                    lambda: pm.optimizer(torch.optim.AdamW)):
        try:
            attempt()
            refused.append("no error")
        except RuntimeError as e:
            refused.append(str(e))
    fxpar.load(path, pm)
    return refused, {k: v.clone() for k, v in pm.full_state_dict().items()}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_meta_device_model_materializes_only_its_shards(pool2, tmp_path, name):
    """Built on the meta device, parallelized at t=2: each rank allocates its shards only (CPU, uninitialized),
    refuses to run until loaded, and after fxpar.load equals the saved model bitwise."""
    path = str(tmp_path / "ckpt")
    full = pool2.run(_save_and_gather, name, path, _layout(d=2))[0]
    for refused, loaded in pool2.run(_from_meta, name, path, _layout(t=2)):
        for message, what in zip(refused, ("would run on garbage", "would save garbage", "optimizer's main")):
            assert "built on the meta device" in message and what in message and "fxpar.load" in message, message
        assert set(loaded) == set(full)
        for k, v in full.items():
            assert torch.equal(loaded[k], v), k


def test_a_meta_buffer_outside_the_state_dict_is_refused():
    import fxpar

    with torch.device("meta"):
        model, args, kwargs = models.build("llama")
    with pytest.raises(ValueError, match="rotary_emb.inv_freq .* is on the meta device but is not in the model's"):
        fxpar.parallelize(model, example_args=(torch.zeros(args[0].shape, dtype=torch.long),),
                          example_kwargs=kwargs)


def _hf_in_and_out(pretrained, exported, layout, meta) -> dict:
    """Load a save_pretrained directory into a parallelized Llama (other weights, or built on meta), export it."""
    import fxpar

    model, args, kwargs = models.build("llama")
    if meta:
        _params_on_meta(model)
    else:
        with torch.no_grad():
            for w in model.parameters():
                w.add_(torch.randn_like(w))
    p, t, d, *_ = layout
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=args, example_kwargs=kwargs,
                           loss_fn=_loss, config=fxpar.Config(microbatches=2))
    fxpar.load(pretrained, pm)
    fxpar.save(exported, pm, format="safetensors", max_shard_mb=0.05)
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


@pytest.mark.parametrize("layout,meta", [(_layout(t=2), False), (_layout(p=2), True)])
def test_hugging_face_safetensors_in_and_out(pool2, tmp_path, layout, meta):
    """A save_pretrained directory loads into the parallelized model (each rank reading its slices; built on meta
    too); fxpar.save(format="safetensors") writes it back as full tensors in several files with the index, and
    from_pretrained reads the result: every weight bitwise."""
    import transformers

    model, _, _ = models.build("llama")
    pretrained, exported = str(tmp_path / "pretrained"), str(tmp_path / "exported")
    model.save_pretrained(pretrained)
    want = model.state_dict()
    for loaded in pool2.run(_hf_in_and_out, pretrained, exported, layout, meta):
        for k, v in want.items():
            assert torch.equal(loaded[k], v), k
    files = sorted(os.listdir(exported))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1, files
    model.config.save_pretrained(exported)  # the weights are fxpar's; the config is the user's to add
    back = transformers.LlamaForCausalLM.from_pretrained(exported).state_dict()
    for k, v in want.items():
        assert torch.equal(back[k], v), k


@pytest.mark.slow
def test_gpt3_175b_on_meta_yields_a_t8_ranks_local_shapes_without_allocating():
    """The 175B model built on the meta device, compiled for rank 0 of t=8 (a simulated rank, as fxpar show does):
    its weights are the local shards' shapes, still on meta, in a process that stays under 1 GiB."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = ("import json, resource, torch\n"
              "from fxpar.api import build\n"
              "from fxpar.passes.tensor_parallel.collectives import TPComm\n"
              "from examples.gpt3_175b import factory\n"
              "with torch.device('meta'):\n"
              "    model, args = factory()\n"
              "pm = build(model, TPComm(rank=0, size=8), args)\n"
              "held = pm.rank.weights.held()\n"
              "print(json.dumps({'shapes': {k: list(v.shape) for k, v in held.items() if k.startswith(('wte', 'lm_', "
              "'blocks.0.'))}, 'devices': sorted({v.device.type for v in held.values()}),\n"
              "                  'params': sum(v.numel() for v in held.values()),\n"
              "                  'rss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    h, shapes = 12288, got["shapes"]
    assert shapes["wte.weight"] == shapes["lm_head.weight"] == [51200 // 8, h]
    assert shapes["blocks.0.qkv.weight"] == [3 * h // 8, h] and shapes["blocks.0.proj.weight"] == [h, h // 8]
    assert shapes["blocks.0.fc.weight"] == [4 * h // 8, h] and shapes["blocks.0.fc_proj.weight"] == [h, 4 * h // 8]
    assert got["devices"] == ["meta"] and 21.8e9 < got["params"] < 22.1e9, got["params"]  # about 175B / 8
    assert got["rss_kib"] < 2**20, got["rss_kib"]  # the rank's 22B parameters would be 88 GB in fp32
