"""A rank's shard of a weight as chunks of the full tensor, the way torch.distributed.checkpoint (DCP) stores it.

DCP saves each tensor as chunks (offsets and sizes in the full tensor) and reads any layout back from any other:
it intersects the chunks a rank asks for with the chunks saved. A plain tensor-parallel shard is one chunk. A
head-interleaved one ([Note: head-interleaved QKV] in passes/ir/placements.py) is several: rank r's block of Q, of K
and of V are three ranges of the fused weight's rows, at three offsets. `chunks` lists them; `Chunked` hands them
to DCP through the protocol DTensor implements (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`), so a checkpoint holds every weight under its original key, in its original layout, with
its full shape, whatever the (p, t, d) it was saved at.

Reading never unpickles code: fxpar's checkpoints hold tensors only (no pickled objects among the items), and
`SafeReader` reads DCP's metadata file with an unpickler that admits only DCP's metadata classes.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader,
                                          HuggingFaceStorageReader)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fxpar.passes.ir.placements import Shard
from fxpar.runtime.weights import first_expert


def chunks(full_shape: tuple[int, ...], spec: Shard | None, rank: int, t: int) -> list[tuple[int, int, int]]:
    """Rank `rank`'s shard as (local start, global start, length) ranges along spec.dim, adjacent ones merged; a
    replicated tensor (spec None) is one range over dim 0 (or a scalar's empty one)."""
    if spec is None:
        return [(0, 0, full_shape[0] if full_shape else 1)]
    ranges, total, local_parts = [], sum(spec.parts), spec.local_parts(t)
    for block in range(spec.pre):
        local, glob = block * sum(local_parts), block * total
        for i, (part, n) in enumerate(zip(spec.parts, local_parts)):
            first = glob if i in spec.whole else glob + rank * n  # a whole part: the same range on every rank
            start = (local * spec.post, first * spec.post, n * spec.post)
            joins = i > 0 and (i in spec.whole) == (i - 1 in spec.whole)  # whole parts: chunks of their own, alike
            if joins and ranges and ranges[-1][0] + ranges[-1][2] == start[0] \
                    and ranges[-1][1] + ranges[-1][2] == start[1]:
                ranges[-1] = (ranges[-1][0], ranges[-1][1], ranges[-1][2] + start[2])
            else:
                ranges.append(start)
            local, glob = local + n, glob + part
    return ranges


class Chunked:
    """`local`, this rank's shard of a tensor of `full_shape`, as DCP chunks (see the module docstring)."""

    def __init__(self, local: torch.Tensor, full_shape: tuple[int, ...], spec: Shard | None, rank: int, t: int,
                 first_expert: int | None = None):
        """first_expert: where this rank's experts start along dim 0 (a weight split over ep; None: not split)."""
        self.local, self.full_shape = local, torch.Size(full_shape)
        self.dim = spec.dim if spec is not None else 0
        if first_expert is not None:  # the tp chunks of this rank's experts, then moved to where they start
            full_shape = (local.shape[0], *full_shape[1:])
        self.pieces = {}  # global offsets -> the local view
        for local_start, global_start, n in chunks(tuple(full_shape), spec, rank, t):
            offsets = [0] * len(full_shape)
            if full_shape:
                offsets[self.dim] = global_start
                offsets[0] += first_expert or 0
            view = local.narrow(self.dim, local_start, n) if full_shape else local
            self.pieces[torch.Size(offsets)] = view

    @classmethod
    def of(cls, pm, key: str, local: torch.Tensor | None = None) -> Chunked:
        """`local` (default: the tensor `pm` holds under `key`) as chunks of `key`'s full tensor, in `key`'s tp
        layout; a scalar (an optimizer's step count) is replicated."""
        local = pm.rank.weights.live[key].detach() if local is None else local
        if not local.dim():
            return cls(local, (), None, 0, 1)
        w = pm.rank.weights
        first = first_expert(local, w.ep) if w.expert(key) else None
        return cls(local, w.shapes[key], w.spec(key), pm.rank.comm.rank, pm.rank.comm.size, first)

    def size(self) -> torch.Size:
        return self.full_shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, view.shape),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.full_shape))
                for offsets, view in self.pieces.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, view.shape) for offsets, view in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.offset]


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner over a flat dict, reading `Chunked` values chunk by chunk (a chunk that is part of
    its tensor is written from a contiguous copy)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            view = value.__get_tensor_shard__(index).detach()
            whole = view.is_contiguous() and view.storage_offset() == 0 and \
                view.untyped_storage().nbytes() == view.numel() * view.element_size()
            return view if whole else view.contiguous().clone()  # torch.save writes a view's whole storage
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat dict, reading into the views of `Chunked` values (in place: the local
    tensors fill)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default's first step materializes meta tensors and drops values of other types, Chunked among them
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "device", "layout", "memory_format", "strided"} | {
        name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    "pathlib": {"PosixPath", "WindowsPath", "Path"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"fxpar: the checkpoint's .metadata names {module}.{name}, which is not DCP "
                                     "metadata; refusing to unpickle it (checkpoints load weights only)")


class ReadsMetadataOnce:
    """A storage reader mixin: the metadata is read once, for fxpar's checks and then for dcp.load."""

    def read_metadata(self, *args, **kwargs):
        if getattr(self, "_metadata", None) is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class HFReader(ReadsMetadataOnce, HuggingFaceStorageReader):
    """torch's Hugging Face safetensors reader, reading every file's header once."""


class _SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeReader(ReadsMetadataOnce, _SafeFileSystemReader):
    """torch's FileSystemReader, reading the metadata file (once) with `_MetadataUnpickler` instead of pickle.load."""


def is_leader() -> bool:
    """Rank 0 of the default group, or the only process: the rank that writes and renames a checkpoint's files."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
