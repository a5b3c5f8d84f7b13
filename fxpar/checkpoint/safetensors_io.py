"""Hugging Face weights in and out: a `save_pretrained` directory of safetensors files, read or written by shards.

    fxpar.load("llama-dir", pm)                                   # a directory of *.safetensors (no fxpar.json)
    fxpar.save("export-dir", pm, format="safetensors")            # full tensors, Hugging Face's file layout

Both go through torch.distributed.checkpoint's own Hugging Face storage (torch/distributed/checkpoint/hf_storage.py)
with fxpar's chunks (fxpar/checkpoint/chunks.py), under the model's state_dict keys, which are a Hugging Face model's
checkpoint keys:
    load   every rank reads only the slices it owns (safetensors `get_slice`), whatever layout wrote the files;
           a key the files leave out because it is tied to another (`lm_head.weight` = `model.embed_tokens.weight`)
           is read from the key it is tied to
    save   every rank writes its own shards, then rank 0 consolidates them into full tensors, one output tensor at
           a time (`consolidate_safetensors_files`), split into files of at most `max_shard_mb`, with
           `model.safetensors.index.json`; tied keys are written once, as `save_pretrained` does. Weights only: no
           optimizer state (use the DCP format to resume training)
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from fxpar.checkpoint.chunks import Chunked, HFReader, LoadPlanner, SavePlanner, barrier, is_leader

SUFFIX = ".safetensors"


def is_safetensors_dir(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(SUFFIX) for f in os.listdir(path))


def load_safetensors(path: str, pm) -> None:
    """Read a directory of safetensors files into `pm` (see the module docstring). Collective."""
    reader = HFReader(path)
    saved = reader.read_metadata().state_dict_metadata
    mine = pm.rank.weights.held_keys()
    by_tensor: dict[str, list[str]] = {}
    for k in pm.rank.weights.keys:
        by_tensor.setdefault(pm.rank.weights.aliases[k], []).append(k)
    unexpected = sorted(set(saved) - set(pm.rank.weights.aliases))
    if unexpected:
        raise ValueError(f"fxpar.load: {path} holds {unexpected[0]}" + (f" (and {len(unexpected) - 1} more)" if
                         len(unexpected) > 1 else "") + ", which the model does not have: they are another model's")
    items = {}
    for key in mine:
        source = next((k for k in by_tensor[pm.rank.weights.aliases[key]] if k in saved), None)
        if source is None:
            raise ValueError(f"fxpar.load: {path} has no {key} (nor a key tied to it): the files are another "
                             "model's, or incomplete")
        if tuple(saved[source].size) != tuple(pm.rank.weights.shapes[key]):
            raise ValueError(f"fxpar.load: {path} holds {source} of shape {tuple(saved[source].size)}; the model's "
                             f"{key} is {tuple(pm.rank.weights.shapes[key])}")
        if source not in items:
            items[source] = Chunked.of(pm, key)
    with torch.no_grad():
        dcp.load(items, storage_reader=reader, planner=LoadPlanner())
    pm.rank.weights.mark_loaded()


def save_safetensors(path: str, pm, max_shard_mb: float = 5 * 1024) -> str:
    """Write `pm`'s weights as full tensors in Hugging Face's safetensors layout (see the module docstring).
    Collective; rank 0 writes the consolidated files."""
    pm.rank.weights.check_loaded("would save garbage")
    keys = [k for k in pm.rank.weights.keys if pm.rank.weights.aliases[k] == k]  # tied keys once, as save_pretrained
    mine = {k: Chunked.of(pm, k) for k in keys if k in pm.rank.weights.slots}
    index, size, limit = {}, 0, max_shard_mb * 2**20
    files = 1
    for k in keys:  # every rank knows every key's full shape; the dtype is the same on every stage
        nbytes = torch.Size(pm.rank.weights.shapes[k]).numel() * _element_size(pm, k)
        if size and size + nbytes > limit:
            files, size = files + 1, 0
        index[k], size = files, size + nbytes
    rank0 = is_leader()
    if rank0 and os.path.exists(path):
        shutil.rmtree(path)
    barrier()
    writer = HuggingFaceStorageWriter(path, fqn_to_index_mapping=index, save_distributed=True,
                                      enable_consolidation=True)
    dcp.save(mine, storage_writer=writer, planner=SavePlanner())
    barrier()
    if rank0:
        shutil.rmtree(os.path.join(path, "sharded"), ignore_errors=True)
    return path


def _element_size(pm, key: str) -> int:
    """The dtype size of `key`'s tensor: held here, or (another stage's) the size of any floating weight held."""
    if key in pm.rank.weights.slots:
        return pm.rank.weights.live[key].element_size()
    return next(t.element_size() for t in pm.rank.weights.held().values() if t.is_floating_point())
