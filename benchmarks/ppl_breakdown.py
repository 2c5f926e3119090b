"""Where the served model's perplexity gap to the GGUF's own dequantized weights comes from: one served model
(built as peer_engine.py builds it, i.e. as `edgeinfer serve` does), the same text and chunks as peer_engine's
--ppl, and each inexact part swapped for exact fp32 one at a time, in one process:

  q4 <names>   the Q4_1 linears named (qkv_proj, o_proj, gate_up_proj, down_proj, or all): dequantize the layer's
               weight to fp32 (kernels.cpu.q4_1x8_dequant, exact) and an fp32 GEMM instead of int8 activations
  head         the tied Q8_0 head: "fp32" (exactly dequantized rows, fp32 GEMM), "plain" (int8 activations
               on every channel: the head before docs/notes/ppl.md) or "served" (int8 activations but the
               few outlier channels the model keeps exact: Q8Linear.keep_exact)
  step_ops     kernels.cpu.attn's C++ ops (rms_norm, add_rms_norm_, rope_kv_store_, silu_mul, decode_attention)
               swapped for their torch references (kernels.cpu.attn_reference)

plus `--decode`: the same teacher-forced perplexity through decode steps (all chunks as one batch, one token per
sequence per step: the path that generates served tokens: Q4/head GEMMs of `len(chunks)` rows, decode_attention)
and `--kv fp8_e4m3` rows. Prints one JSON line per variant and a summary.

  OMP_NUM_THREADS=1 python benchmarks/ppl_breakdown.py [--chunks 4] [--decode] [--variants a,b,...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

Q4_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def exact_q4_forward(self, x):
    """W4A16Linear.forward's dense branch: fp32 x @ (exactly dequantized Q4_1 weight).T."""
    import edgeinfer.kernels.cpu as cpu_kernels

    n, k = self._shape
    x2 = x.reshape(-1, k).float()
    y = x2 @ cpu_kernels.q4_1x8_dequant(self.q4_1x8, n, cpu_kernels.scratch(n, k)).t()
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


SERVED_HEAD_CHANNELS: dict = {}   # the served head's exact channels (Q8Linear.keep_exact), saved once


def set_variant(model, q4: set[str], head: str, step_ops_ref: bool) -> None:
    """head: "served" (as built: int8 activations but the exact channels) | "plain" (int8 activations, no
    exact channels: the head before docs/notes/ppl.md) | "fp32" (exactly dequantized rows, fp32 GEMM)."""
    import edgeinfer.backend.model.linear as linear
    import edgeinfer.kernels.cpu.attn as cpu_attn
    from edgeinfer.kernels.cpu import attn_reference

    for name, m in model.named_modules():
        if isinstance(m, linear.W4A16Linear):
            assert m.q4_1x8 is not None, f"{name}: not on kernels.cpu's Q4_1 path"
            if name.rsplit(".", 1)[-1] in q4:
                m.forward = types.MethodType(exact_q4_forward, m)
            elif "forward" in m.__dict__:
                del m.forward
    lm = model.lm_head_linear
    assert isinstance(lm, linear.Q8Linear)
    SERVED_HEAD_CHANNELS.setdefault("idx", lm.exact_idx)
    lm.keep_exact(None if head == "plain" else SERVED_HEAD_CHANNELS["idx"])
    linear.HEAD_DENSE_MIN_ROWS = 0 if head == "fp32" else 1 << 30
    model.step_ops = attn_reference if step_ops_ref else cpu_attn.ops()


def decode_logits(model, chunks: list[list[int]], kv_dtype: str, page: int = 16):
    """Teacher-forced: step i feeds token i of every chunk as one decode row per sequence; returns the logits
    of steps 0..L-2 as [B * (L-1), vocab] in chunk order (chunk 0's rows first), as evaluate() orders them."""
    import torch

    from edgeinfer.backend.engine.config import EngineConfig
    from edgeinfer.backend.engine.model_runner import ModelRunner
    from edgeinfer.backend.model.llama import AttentionMetadata

    b, n = len(chunks), len(chunks[0])
    pages_per = (n + page - 1) // page
    runner = ModelRunner(model, EngineConfig(page_size=page, num_pages=b * pages_per, kv_dtype=kv_dtype))
    tables = torch.arange(b * pages_per, dtype=torch.int32).reshape(b, pages_per)
    toks = torch.tensor(chunks, dtype=torch.long)
    out = []
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    for i in range(n - 1):
        meta = AttentionMetadata(
            slot_mapping=(tables[:, i // page].long() * page + i % page), num_decode=b,
            decode_block_tables=tables, decode_context_lens=torch.full((b,), i + 1, dtype=torch.int32),
            prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32), prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
            prefill_context_lens=empty_i32)
        with torch.inference_mode():
            h = model(toks[:, i], torch.full((b,), i, dtype=torch.long), runner.kv, meta)
            out.append(model.compute_logits(h))
    return torch.stack(out, 1).reshape(b * (n - 1), -1)


def scored_rows(chunks: list[list[int]], first: int):
    """Row mask over the chunk-major logits ([len(c) - 1] rows per chunk): rows predicting token >= first."""
    import torch

    return torch.cat([torch.arange(1, len(c)) >= first for c in chunks])


def ppl_of(logits, chunks, mask, ref_logp=None) -> tuple[float, object, float | None]:
    """(perplexity over the masked rows, argmax of every row, mean KL(reference || this) over the masked rows)."""
    import torch

    target = torch.tensor([t for c in chunks for t in c[1:]])[mask]
    logp = torch.log_softmax(logits[mask].float(), -1)
    nll = float(-logp.gather(1, target[:, None]).sum())
    kld = None if ref_logp is None else float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    return math.exp(nll / len(target)), logits.argmax(-1), kld


VARIANTS = {   # name -> (q4 layers exact, head, step ops reference)
    "served": (set(), "served", False),
    "head_plain_int8": (set(), "plain", False),
    "q4_exact": (set(Q4_NAMES), "served", False),
    "q4_exact+head_plain_int8": (set(Q4_NAMES), "plain", False),
    "head_exact": (set(), "fp32", False),
    "q4+head_exact": (set(Q4_NAMES), "fp32", False),
    "q4+head_exact+step_ops_ref": (set(Q4_NAMES), "fp32", True),
    "step_ops_ref": (set(), "served", True),
    **{f"q4_exact:{n}": ({n}, "served", False) for n in Q4_NAMES},
}


def main() -> int:
    import torch

    from benchmarks.peer_engine import served_engine
    from edgeinfer.backend.model.gguf_import import ensure_default_model
    from edgeinfer.backend.model.llama import load_model
    from edgeinfer.backend.quant.calib import eval_text, paged_prefill, token_chunks
    from edgeinfer.protocol.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--kv", default="auto", help="served KV dtype for the variants (auto = the served default)")
    ap.add_argument("--decode", action="store_true", help="also each variant through decode steps")
    ap.add_argument("--score-from", type=int, default=1,
                    help="score only tokens at this position of a chunk or later (1: all, as peer_engine; "
                         "chunk_len/2: as llama-perplexity, which scores the second half of each window)")
    a = ap.parse_args()

    ref_dir = ensure_default_model()
    text, name = eval_text()
    chunks = token_chunks(Tokenizer.from_dir(ref_dir).encode(text), a.chunks, a.chunk_len)
    ref = load_model(ref_dir, dtype=torch.float32, device="cpu")
    mask = scored_rows(chunks, a.score_from)
    with torch.inference_mode():
        ref_logits = torch.cat([ref.compute_logits(paged_prefill(ref, [c], "fp32", 16)[:-1]) for c in chunks])
    ref_ppl, ref_pred, _ = ppl_of(ref_logits, chunks, mask)
    ref_logp = torch.log_softmax(ref_logits[mask], -1)
    del ref, ref_logits
    print(json.dumps({"variant": "reference (GGUF dequantized to fp32, fp32 KV, torch path)", "ppl": ref_ppl,
                      "text": name, "chunks": a.chunks, "chunk_len": a.chunk_len, "score_from": a.score_from,
                      "scored_tokens": int(mask.sum())}), flush=True)
    eng, _ = served_engine()
    model = eng.model
    rows = []
    for v in a.variants.split(","):
        set_variant(model, *VARIANTS[v])
        for path in ("prefill", "decode") if a.decode else ("prefill",):
            t = time.monotonic()
            with torch.inference_mode():
                if path == "prefill":
                    logits = torch.cat([model.compute_logits(paged_prefill(model, [c], a.kv, 16)[:-1]) for c in chunks])
                else:
                    logits = decode_logits(model, chunks, a.kv)
            p, pred, kld = ppl_of(logits, chunks, mask, ref_logp)
            row = {"variant": v, "path": path, "kv": a.kv, "ppl": round(p, 4), "over_reference": round(p / ref_ppl, 5),
                   "kld": kld,
                   "greedy_agreement": round(float((pred == ref_pred)[mask].float().mean()), 4),
                   "s": round(time.monotonic() - t, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    set_variant(model, *VARIANTS["served"])
    print(json.dumps({"served_head_exact_channels": None if model.lm_head_linear.exact_idx is None
                      else model.lm_head_linear.exact_idx.tolist()}), flush=True)
    print("| variant | path | ppl | / reference | mean KLD | greedy agreement |", file=sys.stderr)
    for r in rows:
        print(f"| {r['variant']} | {r['path']} | {r['ppl']:.4f} | {r['over_reference']:.5f} | {r['kld']:.6f} | "
              f"{r['greedy_agreement']:.4f} |", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
