"""PagedModel: what the engine needs of a model (backend/engine imports this, never a concrete model).

The one paged decoder (backend/model/decoder.py) satisfies it, and so does tensor parallelism's rank-0 face
(backend/parallel/node.py TensorParallelModel), which mirrors each call on the other ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from edgeinfer.backend.model.batch import AttentionMetadata, LayerKV, PageIO
    from edgeinfer.backend.model.model_config import ModelConfig
    from edgeinfer.backend.model.mtp import MTPLayer


class PagedModel(Protocol):
    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def mtp(self) -> MTPLayer | None:
        """The checkpoint's multi-token-prediction layer (speculative 'mtp'), if loaded."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKV],
                 meta: AttentionMetadata) -> torch.Tensor:
        """One step: [T] ids and positions -> hidden states [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def page_io(self, kv: list[LayerKV]) -> PageIO:
        """Page bodies of this model's KV pool (every rank's share on a tensor-parallel node)."""
        ...

    def weight_bytes(self) -> int: ...

    def prepacked_copy_bytes(self) -> int: ...

    def stop_workers(self) -> None:
        """Tell the other ranks of a tensor-parallel node to stop (nothing to do on one process)."""
        ...
