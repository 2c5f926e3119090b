"""The engine <-> model step contract: what one forward pass reads (AttentionMetadata: the flat batch's slot
mapping, block tables and lengths) and the KV pool's per-layer tensors (LayerKV). The only part of model/ that
engine/ and parallel/ build; its shapes are the kernels' (kernels/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [T] int64
    num_decode: int                        # first num_decode tokens: one per decoding sequence
    decode_block_tables: torch.Tensor      # [B_d, max_pages] int32
    decode_context_lens: torch.Tensor      # [B_d] int32
    prefill_block_tables: torch.Tensor     # [B_p, max_pages] int32
    prefill_cu_seqlens_q: torch.Tensor     # [B_p + 1] int32
    prefill_context_lens: torch.Tensor     # [B_p] int32
    prefill_max_seqlen_q: int | None = None   # longest prefill chunk, from the host (None: the kernel syncs to find it)


@dataclass
class LayerKV:
    k: torch.Tensor                        # [num_pages, page_size, kv_heads, head_dim]; MLA: the latent rows
    v: torch.Tensor                        # MLA: None (its values are the latent's first kv_lora_rank columns)
    k_scale: torch.Tensor | None = None    # [num_pages, page_size, kv_heads] (fp8/int8 only)
    v_scale: torch.Tensor | None = None
    hadamard: bool = False                 # q and k heads rotated before k is stored (kv_pool.KVFormat.hadamard)


class PageIO:
    """Page bodies in and out of one process's KV pool: a page body is the page's bytes in every layer, k, v, then
    the fp8/int8 scales (an MLA pool: the latent and its scale), in layer order (backend/page_store/bridge.py names the
    layout). The engine reads and writes pages only through its model's PageIO (DecoderModel.page_io); a
    tensor-parallel node's spans its ranks (backend/parallel/node.py: world > 1). Engine thread only."""

    world = 1       # processes whose pools one page body spans

    def __init__(self, kv: list[LayerKV]) -> None:
        self.kv = kv

    def parts(self) -> list[torch.Tensor]:
        """The pool tensors in body order, viewed as uint8 ([num_pages, ..., bytes])."""
        out = []
        for c in self.kv:
            out += [t for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
        return [t.view(torch.uint8) for t in out]

    def read_on_device(self, pages: list[int]) -> torch.Tensor:
        """uint8 [len(pages), page body bytes] on the pool's device."""
        parts = self.parts()
        idx = torch.tensor(pages, dtype=torch.long, device=parts[0].device)
        return torch.cat([t.index_select(0, idx).reshape(len(pages), -1) for t in parts], dim=1)

    def read(self, pages: list[int]) -> torch.Tensor:
        """Host uint8 [len(pages), page body bytes]."""
        return self.read_on_device(pages).cpu()

    def write(self, pages: list[int], buf: torch.Tensor) -> None:
        """Host rows buf[i] (page bodies) into pool pages[i]."""
        parts = self.parts()
        dev = parts[0].device
        idx = torch.tensor(pages, dtype=torch.long, device=dev)
        src = buf.to(dev, non_blocking=False)
        n = len(pages)
        off = 0
        for t in parts:
            nb = t[0].numel()
            t.index_copy_(0, idx, src[:, off:off + nb].reshape((n, *t.shape[1:])))
            off += nb
        if off != src.shape[1]:
            raise ValueError(f"page body of {src.shape[1]} bytes, the KV pool needs {off}")
