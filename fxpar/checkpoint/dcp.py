"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format: save at any (p, t, d, v), load at any other.

    fxpar.save("ckpt/step-100", pm, optimizer=opt, extra={"step": 100, "data": position})
    extra = fxpar.load("ckpt/step-100", pm, optimizer=opt)        # any other layout of the same model

What a checkpoint holds, each rank writing only its own shards (as DCP chunks of the full tensors:
fxpar/checkpoint/chunks.py), under the original model's keys with their full shapes, in the original layout
(head-interleaved projections un-interleaved):
    model/<key>            every state_dict key of the model, tied keys included (the model's own state_dict)
    optim/<key>/main       the fp32 main parameter (mixed precision, or the distributed optimizer's pieces joined)
    optim/<key>/<state>    the optimizer's state of that parameter (Adam's exp_avg, exp_avg_sq, step), full shape,
                           whatever d it was sharded over (Config(zero=1) pieces are all-gathered over dp to save
                           and cut again to load)
    rng/<tp>.<pp>.<dp>/... each rank's random streams, restored when the layout is unchanged
    fxpar.json             the manifest, written last: the layout, the optimizer's class and hyperparameters,
                           `extra`, and every file's size (keys and shapes are DCP's own metadata)
The directory is a DCP checkpoint: `torch.distributed.checkpoint.load({"model/" + k: t ...}, checkpoint_id=path)`
reads it into any layout, and `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` converts it.

[Note: crash safety]
    save writes into `<path>.partial`, the manifest last (it lists every file and its size), then renames the
    directory to `<path>` (an existing `<path>` is first renamed aside and removed after). A save killed at any
    point leaves at most a `.partial` directory and the previous checkpoints as they were. load refuses a
    directory without a manifest, with a file missing or of another size, or with keys or shapes that differ from
    the model, with an error that starts with "fxpar" and names what is wrong. Loading never unpickles code.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fxpar.checkpoint.chunks import Chunked, LoadPlanner, SafeReader, SavePlanner, barrier, is_leader

MANIFEST = "fxpar.json"
FORMAT = "fxpar-checkpoint-1"


# ---- the API --------------------------------------------------------------------------------------------------
def save(path: str | os.PathLike, pm, optimizer=None, extra: dict | None = None, format: str = "dcp",
         max_shard_mb: float = 5 * 1024) -> str:
    """Write `pm` (and `optimizer`, and the JSON-serializable `extra`) to the checkpoint directory `path`; every rank
    calls it (collective). Returns the path. See the module docstring. format="safetensors" writes the weights only,
    as full tensors in Hugging Face's layout (files of at most max_shard_mb; fxpar/checkpoint/safetensors_io.py)."""
    path = os.fspath(path)
    if format not in ("dcp", "safetensors"):
        raise ValueError(f"fxpar.save: format must be 'dcp' or 'safetensors', got {format!r}")
    if format == "safetensors":
        if optimizer is not None or extra is not None:
            raise ValueError("fxpar.save: format='safetensors' holds the weights only; save the optimizer and extra "
                             "in the default format='dcp'")
        from fxpar.checkpoint.safetensors_io import save_safetensors

        return save_safetensors(path, pm, max_shard_mb)
    try:
        json.dumps(extra)
    except TypeError as e:
        raise ValueError(f"fxpar.save: extra must be JSON-serializable (checkpoints load weights only): {e}") from None
    pm.rank.weights.check_loaded("would save garbage")
    items, layout = model_items(pm), layout_of(pm)
    manifest = {"format": FORMAT, "layout": layout, "extra": extra}
    if optimizer is not None:
        items.update(optimizer_items(optimizer_tensors(pm, optimizer), pm))
        manifest["optimizer"] = {"class": type(getattr(optimizer, "optimizer", optimizer)).__name__,
                                 "param_groups": [_hyper(g) for g in optimizer.param_groups]}
    items.update(rng_items(pm))
    partial = path + ".partial"
    leader = is_leader()
    if leader and os.path.exists(partial):
        shutil.rmtree(partial)
    barrier()
    try:
        dcp.save(items, storage_writer=dcp.FileSystemWriter(partial, sync_files=True), planner=SavePlanner())
    except RuntimeError as e:  # a rank died or failed mid-save: the others' collectives fail
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(f"fxpar.save: rank {rank}: the save into {partial} failed, on this rank or another "
                           f"({e}). Checkpoints saved before are untouched; {partial} is incomplete and fxpar.load "
                           "refuses it.") from e
    if leader:
        manifest["files"] = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
        _write_json(os.path.join(partial, MANIFEST), manifest)
        aside = path + ".previous"
        if os.path.exists(path):
            os.rename(path, aside)
        os.rename(partial, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(aside, ignore_errors=True)
    barrier()
    return path


def load(path: str | os.PathLike, pm, optimizer=None) -> dict | None:
    """Read the checkpoint at `path` into `pm` (and `optimizer`), whatever layout it was saved at; every rank calls
    it (collective). Returns the `extra` it was saved with. A directory of Hugging Face safetensors files (a
    save_pretrained directory) loads the weights, each rank reading only its slices
    (fxpar/checkpoint/safetensors_io.py)."""
    from fxpar.checkpoint.safetensors_io import is_safetensors_dir, load_safetensors

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, MANIFEST)) and is_safetensors_dir(path):  # Hugging Face weights
        if optimizer is not None:
            raise ValueError(f"fxpar.load: {path} holds safetensors weights only; load it with optimizer=None")
        load_safetensors(path, pm)
        return None
    if os.path.isfile(path) and path.endswith(".safetensors"):
        raise ValueError(f"fxpar.load: {path} is a file; pass the directory that holds it (and its index)")
    manifest = read_manifest(path)
    reader = SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata
    _check_keys(path, pm, saved)
    layout = layout_of(pm)
    items = model_items(pm)
    targets = {}
    if optimizer is not None:
        if "optimizer" not in manifest:
            raise ValueError(f"fxpar.load: {path} was saved without an optimizer; load it with optimizer=None")
        _check_optimizer(path, optimizer, manifest["optimizer"])
        targets = _optimizer_targets(pm, saved)
        items.update(optimizer_items(targets, pm))
    rng = rng_items(pm) if {"ep": 1, **manifest["layout"]} == layout else {}  # saved before ep: ep=1
    items.update(rng)
    with torch.no_grad():
        dcp.load(items, storage_reader=reader, planner=LoadPlanner())
    pm.rank.weights.mark_loaded()  # every key this rank holds was in the checkpoint (_check_keys)
    if optimizer is not None:
        set_optimizer_tensors(pm, optimizer, targets)
        _set_hyper(path, optimizer, manifest["optimizer"])
    if rng:
        pm.rank.streams.set_states({k.rsplit("/", 1)[1]: v.local for k, v in rng.items()})
    return manifest["extra"]


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under `root` (by the manifest's modification time), or None."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    done = [os.path.join(root, d) for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, MANIFEST))]
    return max(done, key=lambda d: os.path.getmtime(os.path.join(d, MANIFEST)), default=None)


# ---- what a rank saves ------------------------------------------------------------------------------------------
def layout_of(pm) -> dict:
    g = pm.rank.groups
    return {"tp": pm.rank.comm.size, "pp": g.pp if g else 1, "dp": g.dp if g else 1, "ep": g.ep if g else 1,
            "vpp": pm.config.virtual_stages}


def model_items(pm) -> dict[str, Chunked]:
    """model/<key> -> this rank's tensor of every key it holds, tied keys included."""
    return {f"model/{k}": Chunked.of(pm, k) for k in pm.rank.weights.held_keys()}


def optimizer_items(tensors: dict[str, dict[str, torch.Tensor]], pm) -> dict[str, Chunked]:
    """optim/<key>/<name> -> each optimizer tensor of `key` (see optimizer_tensors), in its parameter's layout."""
    return {f"optim/{k}/{name}": Chunked.of(pm, k, t) for k, states in tensors.items() for name, t in states.items()}


def rng_items(pm) -> dict[str, Chunked]:
    """rng/<tp>.<pp>.<dp>/<stream> -> this rank's random stream states ([Note: random streams] in
    passes/tensor_parallel/rng.py)."""
    g = pm.rank.groups
    where = f"{pm.rank.comm.rank}.{g.pp_rank if g else 0}.{g.dp_rank if g else 0}"
    return {f"rng/{where}/{name}": Chunked(state.clone(), tuple(state.shape), None, 0, 1)
            for name, state in pm.rank.streams.get_states().items()}


def optimizer_tensors(pm, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """key -> {"main": fp32 main parameter (where the optimizer has one), state name: tensor}, every tensor of the
    parameter's local shape (or a scalar): the distributed optimizer's pieces are all-gathered over dp."""
    from fxpar.runtime.optim import MainParamsOptimizer, trainable
    from fxpar.runtime.zero import DistributedOptimizer

    params = trainable(pm)
    if isinstance(optimizer, DistributedOptimizer):
        return _joined(optimizer, {k: _with_main(optimizer, k) for k in params}, params)
    if isinstance(optimizer, MainParamsOptimizer):
        return {k: _with_main(optimizer, k) for k in params}
    key_of = {p: k for k, p in params.items()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in key_of:
                raise ValueError("fxpar.save: the optimizer steps a tensor that is not one of pm's parameters; "
                                 "make it with pm.optimizer(cls, ...) or over pm.parameters()")
            out[key_of[p]] = _checked(key_of[p], optimizer.state.get(p, {}), p)
    return out


def _with_main(optimizer, key: str) -> dict[str, torch.Tensor]:
    main = optimizer.main[key]
    return {"main": main.detach(), **_checked(key, optimizer.optimizer.state.get(main, {}), main)}


def _checked(key: str, state: dict, param: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"fxpar.save: optimizer state {key}/{name} is a {type(value).__name__}, not a tensor; "
                             "checkpoints hold tensors only")
        if value.dim() and value.shape != param.shape:
            raise ValueError(f"fxpar.save: optimizer state {key}/{name} has shape {tuple(value.shape)}, not its "
                             f"parameter's {tuple(param.shape)}: only elementwise optimizer state can be resharded")
        out[name] = value.detach()
    return out


def _joined(optimizer, pieces: dict[str, dict[str, torch.Tensor]], params: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The distributed optimizer's pieces (key -> name -> piece) joined into the parameters' local shapes: one
    all-gather over dp per state name (every dp rank holds the same names and shapes); scalars are kept."""
    out = {k: {n: t for n, t in states.items() if not t.dim()} for k, states in pieces.items()}
    for name in sorted({n for states in pieces.values() for n, t in states.items() if t.dim()}):
        keys = [k for k, states in pieces.items() if name in states]
        mine = [pieces[k][name] for k in keys]
        for k, full in zip(keys, optimizer.gather(mine, [params[k] for k in keys], mine[0].dtype)):
            out[k][name] = full
    return out


# ---- what a rank loads ------------------------------------------------------------------------------------------
def _optimizer_targets(pm, saved: dict) -> dict[str, dict[str, torch.Tensor]]:
    """key -> {name: an empty tensor of the parameter's local shape (or a scalar), the saved dtype} for each
    optimizer tensor the checkpoint holds of this rank's parameters."""
    from fxpar.runtime.optim import trainable

    params, out = trainable(pm), {}
    for fqn, md in saved.items():
        if not fqn.startswith("optim/"):
            continue
        key, name = fqn[len("optim/"):].rsplit("/", 1)
        if key in params:
            shape = params[key].shape if len(md.size) else ()
            out.setdefault(key, {})[name] = torch.empty(shape, dtype=md.properties.dtype,
                                                        device=params[key].device)
    return out


def set_optimizer_tensors(pm, optimizer, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """Install loaded optimizer tensors (see optimizer_tensors): main parameters copied in (from the loaded weights
    where the checkpoint has none), state replacing the optimizer's."""
    from fxpar.runtime.optim import MainParamsOptimizer, trainable
    from fxpar.runtime.zero import DistributedOptimizer

    for key, p in trainable(pm).items():
        def mine(t):  # this rank's piece ([Note: pieces] in fxpar/runtime/zero.py)
            return optimizer.piece(p, t) if t.dim() else t

        states = dict(tensors.get(key, {}))
        main = states.pop("main", None)
        if main is None:
            main = p.detach()
        if isinstance(optimizer, DistributedOptimizer):
            target = optimizer.main[key]
            target.data.copy_(mine(main.float()))
            optimizer.optimizer.state[target] = {n: mine(t) for n, t in states.items()}
        elif isinstance(optimizer, MainParamsOptimizer):
            target = optimizer.main[key]
            target.data.copy_(main)
            optimizer.optimizer.state[target] = states
        else:
            optimizer.state[p] = states


def _hyper(group: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))}


def _check_optimizer(path: str, optimizer, saved: dict) -> None:
    name = type(getattr(optimizer, "optimizer", optimizer)).__name__
    if saved["class"] != name or len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"fxpar.load: {path} holds a {saved['class']} with {len(saved['param_groups'])} parameter "
                         f"groups; the optimizer given is a {name} with {len(optimizer.param_groups)}")


def _set_hyper(path: str, optimizer, saved: dict) -> None:
    for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
        for k, v in hyper.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


# ---- the directory ----------------------------------------------------------------------------------------------
def read_manifest(path: str) -> dict:
    """The manifest of a complete checkpoint, every file present at its size ([Note: crash safety])."""
    if not os.path.isdir(path):
        partial = " (an unfinished save is at " + path + ".partial)" if os.path.isdir(path + ".partial") else ""
        raise FileNotFoundError(f"fxpar.load: no checkpoint at {path}{partial}")
    where = os.path.join(path, MANIFEST)
    if not os.path.isfile(where):
        raise ValueError(f"fxpar.load: {path} is not a complete fxpar checkpoint: {MANIFEST} is missing (it is written "
                         "last, so the save did not finish)")
    try:
        with open(where) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"fxpar.load: {where} is damaged: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"fxpar.load: {where} is not an fxpar checkpoint manifest (format {FORMAT})")
    for name, size in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ValueError(f"fxpar.load: {path} is damaged: {name} is missing")
        if os.path.getsize(file) != size:
            raise ValueError(f"fxpar.load: {path} is damaged: {name} is {os.path.getsize(file)} bytes, "
                             f"{size} were written")
    return manifest


def _check_keys(path: str, pm, saved: dict) -> None:
    mine = pm.rank.weights.held_keys()
    missing = [k for k in mine if f"model/{k}" not in saved]
    if missing:
        raise ValueError(f"fxpar.load: {path} has no {missing[0]}" + (f" (nor {len(missing) - 1} more keys)" if
                         len(missing) > 1 else "") + ": it was saved from another model")
    extra = sorted(set(f[len("model/"):] for f in saved if f.startswith("model/")) - set(pm.rank.weights.keys))
    if extra:
        raise ValueError(f"fxpar.load: {path} holds {extra[0]}" + (f" (and {len(extra) - 1} more keys)" if
                         len(extra) > 1 else "") + ", which the model does not have: it was saved from another model")
    for k in mine:
        got = tuple(saved[f"model/{k}"].size)
        if got != tuple(pm.rank.weights.shapes[k]):
            raise ValueError(f"fxpar.load: {path} holds {k} of shape {got}; the model's is "
                             f"{tuple(pm.rank.weights.shapes[k])}")


def _write_json(file: str, value: dict) -> None:
    with open(file, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

