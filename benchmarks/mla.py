"""MLA's latent KV pages measured: bytes per token, sequences that fit, absorbed vs expanded decode, the two prefill
forms, fp8 vs fp32 latent pages, and llama.cpp's deepseek2 on the same checkpoint.

  python -m benchmarks mla [--quick] [--threads 2] [--llamacpp-build DIR --llamacpp-src DIR] [--out FILE]

Models (random weights, transformers' own config classes, fp32): a DeepSeek-V3 attention stack with Kimi K2's
latent (kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values a token and layer; hidden 1024, 16 heads, q LoRA 384,
qk_nope 128, v 128, 4 layers, dense MLPs: the bench is about attention), and a GQA Llama of the same hidden size
(16 heads, 4 KV heads of 64). Measured in this process, one model at a time:
  - KV bytes per token (the engine's own ModelRunner.bytes_per_token) for MLA fp32 / fp8 and GQA fp32 / fp8, and
    the sequences of 4k tokens that fit in a fixed 1 GiB KV budget;
  - decode ms per step at 1 / 8 / 32 sequences of --context tokens: absorbed (W_UK folded into the query, the
    latent pages read as they are; attention by the C++ op kernels.cpu.attn.mla_decode_attention), the same with
    torch ops for the attention (`absorbed_torch`, what the CPU path did before the op), and expanded (every context
    latent expanded through kv_b_proj each step);
  - the decode attention op alone (attention_op): the C++ op vs the torch reference, fp32 and int8 latent pages,
    contexts 512 / 4096, 1 / 8 / 32 sequences, 16 and 64 query heads;
  - prefill of --prefill tokens: expanded vs latent form;
  - fp8 vs fp32 latent pages: mean KL(fp32 || fp8) of the next-token distributions, teacher-forced over 4 chunks of
    a real text (the model is random: this measures the pages' numeric fidelity, not language quality), and the
    argmax agreement;
  - with --llamacpp-build: llama.cpp's llama-bench (pp --prefill, tg 64) on the same checkpoint converted by its
    own convert_hf_to_gguf.py to an f32 GGUF (arch deepseek2), against edgeinfer's batch-1 decode and prefill.
Writes --out (default benchmarks/results/mla.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402

MLA_SHAPE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                 first_k_dense_replace=4, n_group=1, topk_group=1, max_position_embeddings=4096)
GQA_SHAPE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
BUDGET_BYTES = 1 << 30
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def build(kind: str, out: Path, vocab: int, tokenizer_dir: Path) -> None:
    from tests.support.hf_compat import hide_hub_kernels

    hide_hub_kernels()
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = (DeepseekV3Config(vocab_size=vocab, **MLA_SHAPE) if kind == "mla"
           else LlamaConfig(vocab_size=vocab, **GQA_SHAPE))
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer_dir / f, out / f)


def kv_bytes(model_dir: Path) -> dict:
    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.model_runner import ModelRunner
    from edgeinfer.backend.model.loader import load_model

    model = load_model(model_dir)
    out = {}
    for kv_dtype in ("fp32", "fp8_e4m3"):
        r = ModelRunner(model, EngineConfig(num_pages=4, kv_dtype=kv_dtype, cuda_graphs=False))
        out[kv_dtype] = {"bytes_per_token": r.bytes_per_token, "format": r.kv_format.ident,
                         "sequences_at_4k_in_1GiB": BUDGET_BYTES // (r.bytes_per_token * 4096)}
    return out


def decode_and_prefill(model_dir: Path, levels: list[int], context: int, prefill: int, steps: int) -> dict:
    from edgeinfer.backend.model.loader import load_model
    from tests.support.dense import decode_batch, prefill_batch

    model = load_model(model_dir)
    out: dict = {"decode_ms": {}, "prefill_ms": {}}
    g = torch.Generator().manual_seed(0)
    for form in ("absorbed", "absorbed_torch", "expanded"):
        for layer in model.layers:
            attn = layer.self_attn
            attn.decode_form = "expanded" if form == "expanded" else "absorbed"
            attn.__dict__.pop("decode", None)
            if form == "absorbed_torch":   # the same absorbed form with torch ops for the attention (no C++ op)
                attn.decode = (lambda a: lambda qn, qp, kv, meta, ops=None: type(a).decode(a, qn, qp, kv, meta))(attn)
        out["decode_ms"][form] = {}
        for b in levels:
            kv, positions, meta = decode_batch(model, b, context)
            for layer_kv in kv:   # a context of random latent rows (what attention reads; values do not matter)
                layer_kv.k.normal_(generator=g)
            ids = torch.randint(100, 40000, (b,), generator=g)
            for _ in range(2):
                model.compute_logits(model(ids, positions, kv, meta))
            t = time.perf_counter()
            for _ in range(steps):
                model.compute_logits(model(ids, positions, kv, meta))
            out["decode_ms"][form][str(b)] = round((time.perf_counter() - t) / steps * 1000, 2)
            say(f"  decode {form} x{b}: {out['decode_ms'][form][str(b)]} ms/step")
    for form in ("expanded", "latent"):
        for layer in model.layers:
            layer.self_attn.prefill_form = form
        kv, meta = prefill_batch(model, prefill)
        ids = torch.randint(100, 40000, (prefill,), generator=g)
        model(ids, torch.arange(prefill), kv, meta)
        t = time.perf_counter()
        for _ in range(2):
            model(ids, torch.arange(prefill), kv, meta)
        out["prefill_ms"][form] = round((time.perf_counter() - t) / 2 * 1000, 1)
        say(f"  prefill {form} {prefill} tokens: {out['prefill_ms'][form]} ms")
    return out


def attention_op(contexts: list[int], levels: list[int], heads: list[int], reps: int) -> dict:
    """The MLA decode attention alone, ms per call: the C++ op (kernels.cpu.attn.mla_decode_attention) against
    the torch reference it replaced on the CPU path (gather the rows, dequantize, two einsums), on Kimi K2's latent
    rows (512 + 64) in fp32 and int8 pages, per context, batch and query-head count (16: this bench's model and
    DeepSeek-V2-Lite; 64: Kimi K2)."""
    from edgeinfer.kernels.cpu import attn as cpu_attn
    from edgeinfer.kernels.cpu import attn_reference
    from edgeinfer.kernels.paged_mla_attention import mla_latent_store

    ext = cpu_attn._ext()
    rank, rope, page = 512, 64, 16
    out: dict = {}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.int8):
        for ctx in contexts:
            pages_per = ctx // page
            for b in levels:
                cache = torch.zeros(b * pages_per, page, 1, rank + rope, dtype=dtype)
                scale = torch.ones(cache.shape[:3], dtype=torch.bfloat16) if dtype == torch.int8 else None
                for i in range(b):   # one sequence's rows at a time (bounded temporary)
                    rows = torch.randn(pages_per * page, rank + rope, generator=g)
                    mla_latent_store(rows, cache, torch.arange(i * pages_per * page, (i + 1) * pages_per * page),
                                     scale)
                bt = torch.arange(b * pages_per, dtype=torch.int32).view(b, pages_per)
                cl = torch.full((b,), ctx, dtype=torch.int32)
                for h in heads:
                    q = torch.randn(b, h, rank + rope, generator=g) * 0.05
                    row = {}
                    for name, fn in (("cpp", ext.mla_decode_attention), ("torch", attn_reference.mla_decode_attention)):
                        fn(q, cache, bt, cl, 0.07, rank, scale)
                        t = time.perf_counter()
                        for _ in range(reps):
                            fn(q, cache, bt, cl, 0.07, rank, scale)
                        row[f"{name}_ms"] = round((time.perf_counter() - t) / reps * 1000, 3)
                    row["speedup"] = round(row["torch_ms"] / row["cpp_ms"], 2)
                    key = f"{'int8' if dtype == torch.int8 else 'fp32'} ctx{ctx} x{b} h{h}"
                    out[key] = row
                    say(f"  attention {key}: {row}")
                del cache
    return out


def fp8_agreement(model_dir: Path, chunks: list[list[int]]) -> dict:
    from edgeinfer.backend.model.batch import LayerKV
    from edgeinfer.backend.model.loader import load_model
    from tests.support.dense import fresh_kv, prefill_logits

    model = load_model(model_dir)
    kls, agree, n = 0.0, 0.0, 0
    for ids in chunks:
        kv = fresh_kv(model, -(-len(ids) // 16) + 1)
        fp8 = [LayerKV(torch.zeros_like(x.k, dtype=torch.float8_e4m3fn), None,  # type: ignore[arg-type]
                       torch.ones(x.k.shape[:3], dtype=torch.bfloat16), None) for x in kv]
        want, got = prefill_logits(model, ids, kv), prefill_logits(model, ids, fp8)
        kls += torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                          reduction="sum").item()
        agree += float((got.argmax(-1) == want.argmax(-1)).float().sum())
        n += len(ids)
    return {"tokens": n, "mean_kl_fp32_fp8": kls / n, "argmax_agreement": agree / n}


def llama_cpp(model_dir: Path, work: Path, src: Path, build_dir: Path, threads: int, prefill: int) -> dict:
    from benchmarks.harness.llamacpp import llama_bench
    from benchmarks.harness.servers import find_binary

    gguf = work / "mla-f32.gguf"
    if not gguf.exists():
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        p = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(gguf),
                            "--outtype", "f32"], env=env, capture_output=True, text=True, timeout=1200)
        if p.returncode != 0:
            return {"error": f"convert_hf_to_gguf.py failed: {p.stderr[-2000:]}"}
    binary = find_binary("llama-bench", build_dir)
    if binary is None:
        return {"error": f"no llama-bench under {build_dir}"}
    try:
        return llama_bench(binary, build_dir, gguf, threads, prefill, 64, 2, 1200)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="levels 1,8, context 128, prefill 128, 3 steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=None, help="decode context tokens (default 512)")
    ap.add_argument("--prefill", type=int, default=None, help="prefill tokens (default 512)")
    ap.add_argument("--llamacpp-build", type=Path, default=None)
    ap.add_argument("--llamacpp-src", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "bench_mla")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mla.json")
    a = ap.parse_args(argv)
    levels = [1, 8] if a.quick else [1, 8, 32]
    context = a.context or (128 if a.quick else 512)
    prefill = a.prefill or (128 if a.quick else 512)
    steps = 3 if a.quick else 8
    torch.set_num_threads(a.threads)
    t0, load0 = time.monotonic(), os.getloadavg()
    from edgeinfer.backend.model.gguf_import import ensure_default_model
    from edgeinfer.protocol.tokenizer import Tokenizer

    smol = ensure_default_model()
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    dirs = {k: a.work / k for k in ("mla", "gqa")}
    for kind, d in dirs.items():
        if not (d / "config.json").exists():
            say(f"building the random {kind} checkpoint in {d}")
            build(kind, d, vocab, smol)
    result: dict = {"bench": "bench_mla", "quick": a.quick, "threads": a.threads, "host": platform.node(),
                    "mla_shape": MLA_SHAPE, "gqa_shape": GQA_SHAPE, "budget_bytes": BUDGET_BYTES,
                    "context": context, "prefill": prefill, "levels": levels}
    say("KV bytes per token")
    result["kv"] = {k: kv_bytes(d) for k, d in dirs.items()}
    say("MLA decode (absorbed vs expanded) and prefill (expanded vs latent)")
    result["mla_speed"] = decode_and_prefill(dirs["mla"], levels, context, prefill, steps)
    say("the MLA decode attention op alone: C++ vs torch")
    result["attention_op"] = attention_op([context] if a.quick else [512, 4096], [1, 8] if a.quick else levels,
                                          [16] if a.quick else [16, 64], 2 if a.quick else 5)
    say("fp8 vs fp32 latent pages")
    tok = Tokenizer.from_dir(smol)
    import pydoc_data.topics

    text = tok.encode(Path(pydoc_data.topics.__file__).read_text(encoding="utf-8"))
    chunk = 64 if a.quick else 256
    result["fp8"] = fp8_agreement(dirs["mla"], [text[i * 5000: i * 5000 + chunk] for i in range(4)])
    if a.llamacpp_build is not None and a.llamacpp_src is not None:
        say("llama.cpp deepseek2 on the same checkpoint (f32 GGUF)")
        result["llamacpp"] = llama_cpp(dirs["mla"], a.work, a.llamacpp_src, a.llamacpp_build, a.threads, prefill)
    # ratios
    kv, sp = result["kv"], result["mla_speed"]
    r = {"gqa_fp32 / mla_fp8 bytes per token": round(kv["gqa"]["fp32"]["bytes_per_token"]
                                                     / kv["mla"]["fp8_e4m3"]["bytes_per_token"], 2),
         "mla_fp32 / mla_fp8 bytes per token": round(kv["mla"]["fp32"]["bytes_per_token"]
                                                     / kv["mla"]["fp8_e4m3"]["bytes_per_token"], 3),
         "decode absorbed / expanded speed": {b: round(sp["decode_ms"]["expanded"][b] / sp["decode_ms"]["absorbed"][b], 2)
                                              for b in sp["decode_ms"]["absorbed"]},
         "decode C++ MLA op / torch attention speed": {
             b: round(sp["decode_ms"]["absorbed_torch"][b] / sp["decode_ms"]["absorbed"][b], 2)
             for b in sp["decode_ms"]["absorbed"]},
         "prefill latent / expanded speed": round(sp["prefill_ms"]["expanded"] / sp["prefill_ms"]["latent"], 2)}
    lc = result.get("llamacpp", {})
    rows = {x["test"]: x["tok_s"] for x in lc.get("rows", [])}
    if rows:
        ours_tg = 1000 / sp["decode_ms"]["absorbed"]["1"]
        ours_pp = prefill / (sp["prefill_ms"][min(sp["prefill_ms"], key=sp["prefill_ms"].get)] / 1000)
        r["edgeinfer / llama.cpp batch-1 decode"] = round(ours_tg / rows["tg64"], 3) if "tg64" in rows else None
        r[f"edgeinfer / llama.cpp prefill {prefill}"] = (round(ours_pp / rows[f"pp{prefill}"], 3)
                                                         if f"pp{prefill}" in rows else None)
        r["note"] = ("edgeinfer's batch-1 decode at a context of "
                     f"{context} tokens; llama-bench's tg64 starts from an empty context")
    result["ratios"] = r
    result |= run_stamp(t0, load0)
    write_result(result, a.out, echo=False)
    print(json.dumps({"kv": kv, "mla_speed": sp, "fp8": result["fp8"], "ratios": r,
                      "llamacpp": {k: v for k, v in lc.items() if k != "rows"} | {"rows": rows}}, indent=2))
    say(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
