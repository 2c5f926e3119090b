"""Kernels: each op has a Triton kernel (CUDA) and a pure-torch reference (everywhere else).

Public ops (dispatch on the device of the first tensor argument; the environment
variable EDGEINFER_KERNELS=reference forces the reference on CUDA too):

  kv_store(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None
  paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                         k_scale=None, v_scale=None) -> out
  paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, sm_scale,
                          k_scale=None, v_scale=None) -> out
  w4a16_gemm(x, qweight, scales, zeros=None, group_size=128) -> out
  fused_moe_w4a16(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, group_size=128) -> out  (kernels/fused_moe.py)
  paged_mla_decode_attention(q, cache, block_tables, context_lens, sm_scale, v_dim, scale=None) -> out
  mla_latent_store(latent, cache, slot_mapping, scale=None)  (torch on every device; kernels/paged_mla_attention.py)
  page_checksum(buf) -> [n] int64   (buf: [n, page_bytes] uint8 page bodies; kernels/page_checksum.py)

Every op except kv_store also accepts out= (written and returned). EDGEINFER_KERNELS=triton
forces the Triton kernels (on CPU only under TRITON_INTERPRET=1). Details: docs/KERNELS.md.

Layouts (shape comments are the contract):
  k_cache, v_cache: [num_pages, page_size, kv_heads, head_dim]  (fp32/fp16/bf16, or float8_e4m3fn / int8)
  k_scale, v_scale: [num_pages, page_size, kv_heads] float32 or bfloat16 (only with fp8/int8 caches: per token-head)
  slot_mapping:     [T] int64, slot = page * page_size + offset; -1 = skip this row
  block_tables:     [B, max_pages] int32 (padding entries are ignored beyond context_lens)
  context_lens:     [B] int32, tokens in the cache for each sequence (for prefill: including the new ones)
  cu_seqlens_q:     [B+1] int32, prefix sums of new-token counts; query rows of sequence b are
                    q[cu[b]:cu[b+1]] at positions context_lens[b]-q_len_b ... context_lens[b]-1 (causal)
  qweight:          [N, K//2] uint8, packed along K: low nibble = even k, high nibble = odd k
  scales, zeros:    [N, K//group_size] fp16 (zeros also fp32: fractional, e.g. GGUF Q4_1 mins as -min/scale);
                    w = (q - zeros) * scales; zeros=None -> symmetric (q - 8)
"""

from edgeinfer.kernels.dispatch import (  # noqa: F401
    fused_moe_w4a16,
    fused_moe_w4a16_reference,
    kv_store,
    mla_latent_store,
    page_checksum,
    paged_decode_attention,
    paged_mla_decode_attention,
    paged_prefill_attention,
    w4a16_gemm,
)
