"""Sharded state for ``torch.distributed.checkpoint`` without gathering (DESIGN §9, "sharded state for tools").

DTensor only represents ``torch.chunk``-style unevenness; hapc's shards are sized by the sharding
ratios. DCP, however, plans every read and write from each rank's ``(offset, size)`` chunks, and an
object can describe its own chunks to it -- the checkpointable protocol DTensor implements and
torchrec's ``LocalShardsWrapper`` uses:

* ``__create_write_items__(fqn, obj)``: the write items of this rank's chunk (saving),
* ``__create_chunk_list__()``: the chunks this rank holds (loading: DCP reads every saved chunk
  that overlaps one, from whatever plan or world size wrote them -- resharding by chunks),
* ``__get_tensor_shard__(index)``: the local tensor of a chunk (both ways).

:class:`ShardEntry` is a tensor of the model's whole shape that holds one chunk -- a rank's slice
of dim ``dim`` -- as a view of the module's own shard, so a DCP load writes straight into the
module. Any other use (arithmetic, ``torch.save``) raises: it is not a whole tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import HapcError


class ShardEntry(torch.Tensor):
    """One rank's chunk of a whole tensor of shape ``shape``: ``local`` starts at ``offsets``."""

    _local: torch.Tensor
    _offsets: torch.Size

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> ShardEntry:
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        out._local, out._offsets = local, torch.Size(offsets)
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:  # DCP detaches what it reads into: the same chunk
            return args[0]
        raise HapcError(
            f"{func} on an entry of module.sharded_state_dict(): it holds only this rank's chunk of the tensor, for "
            "torch.distributed.checkpoint (dcp.save / dcp.load); for whole tensors use module.state_dict()"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        shape, offsets, local = tuple(self.shape), tuple(self._offsets), tuple(self._local.shape)
        return f"ShardEntry(shape={shape}, offsets={offsets}, local={local})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise HapcError(
            "an entry of module.sharded_state_dict() holds only this rank's chunk and cannot be pickled: save it "
            "with torch.distributed.checkpoint, or torch.save(module.state_dict()) for whole tensors"
        )

    # -- DCP's checkpointable protocol ------------------------------------------------------------------
    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self._offsets, sizes=self._local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, self._offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and torch.Size(index.offset) != self._offsets:
            raise ValueError(f"{index.fqn}: this rank holds the chunk at {tuple(self._offsets)}, not {index.offset}")
        return self._local


def shard_entry(local: torch.Tensor, dim: int, start: int, shape: tuple[int, ...]) -> ShardEntry:
    """The entry for ``local``, the slice ``[start, start + len)`` of dim ``dim`` of a tensor of ``shape``."""
    offsets = [0] * len(shape)
    offsets[dim] = start
    return ShardEntry(local, tuple(offsets), tuple(shape))
