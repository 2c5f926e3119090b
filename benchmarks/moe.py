"""edgeinfer against llama.cpp on the same GLM-4.5-shaped Mixture-of-Experts GGUF, over OpenAI HTTP, interleaved.

  python -m benchmarks moe [--quick] [--threads 2] [--rounds 2] [--levels 1,8,32]
      [--llamacpp-src DIR] [--llamacpp-build DIR] [--work DIR] [--out FILE]
  python -m benchmarks moe --plan-ab [--work DIR]     (the decode plan on vs off, in-process; no peer)

--plan-ab: the same shape through the project's own Q4_0 GGUF writer (tests/support/moe_checkpoints.py) and the native
import, the model alone in this process: ms per decode step at 1 / 8 / 32 sequences (64 tokens of context) with
the decode plan (backend/model/cpu_decode.py: the C++ layer loop, MoE layers included) and with the module path,
alternated over 6 rounds (medians); writes benchmarks/results/moe.plan_ab.json.

The model: a random GLM-4.5 (transformers' Glm4MoeConfig: sigmoid routing with a correction bias, one shared
expert, the first layer dense, QK-norm, partial rotary, q/k/v bias) large enough to be memory-bound on the CPU:
12 layers of 64 experts, top-8, hidden 768, expert width 384 (0.74B parameters, ~95M active per token;
--quick: 4 layers of 16 experts). Embeddings are tied (one Q8_0 table is the embedding and the head in both
engines: the head of an untied random model would be a third of the bytes read per token and is not what this
bench measures). The tokenizer is SmolLM2's with the four special tokens llama.cpp's GLM vocab needs.

The GGUF is made by llama.cpp's own tools from the saved checkpoint: `convert_hf_to_gguf.py --outtype f16`, then
`llama-quantize --token-embedding-type q8_0 ... Q4_0`. llama-server serves that file; edgeinfer imports the same
file natively (its Q4_0 blocks kept 4-bit, backend/model/gguf_import.py) and `edgeinfer serve --model DIR` serves
it with its defaults. Both with --threads threads, one at a time, started and stopped by this script (loopback).

Load per level c (benchmarks/harness/load.py, as bench_peers.py): c streaming /v1/completions at once, token-id
prompts that share no prefix, greedy, ignore_eos, --max-tokens each: decode tok/s while all c decode; then c
prompts of --prefill-len tokens with max_tokens=1: prefill tok/s. Peak RSS of each server's process tree.
Rounds alternate the order; medians over rounds. edgeinfer runs with its default int8x2 activations (two int8
passes, docs/QUANTIZATION.md) and, as `edgeinfer-int8`, with one int8 pass like llama.cpp's Q8 activations
(--also-activations). Goals (issue: the dense model's): batch-1 decode >= 1.0x llama.cpp, 32 sequences >= 2x. Writes --out (default benchmarks/results/moe.json) and a .md table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import interleaved, run_stamp, write_result  # noqa: E402
from benchmarks.harness.servers import Running, ServerSpec, edgeinfer_spec, find_binary, llamacpp_spec  # noqa: E402
from benchmarks.peers import PEERS_HOME, Prompts, prompt_tokens, run_levels, say  # noqa: E402

GLM_SPECIALS = ["[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"]   # _set_vocab_glm looks them up
SHAPE = dict(hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, head_dim=64, n_routed_experts=64, num_experts_per_tok=8)
QUICK_SHAPE = dict(SHAPE, num_hidden_layers=4, n_routed_experts=16, num_experts_per_tok=4)
# --arch deepseek2 (benchmarks/mla_peer.py): DeepSeek-V2-Lite's attention and expert shapes (a 512-wide latent + 64
# rope, 16 heads of 128 + 64, v 128; 64 experts of width 1408, top-6, 2 shared; the first layer dense with V2-Lite's
# 10944-wide MLP) in 4 layers instead of 27, with DeepSeek-V3's q LoRA (rank 1536: llama.cpp takes a deepseek2
# model without one for V2-Lite only at exactly 27 layers), as a DeepSeek-V3 checkpoint (V3's sigmoid routing with a
# correction bias: V2's softmax greedy routing is not implemented here); llama.cpp converts it to its deepseek2 arch.
DS_SHAPE = dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                num_experts_per_tok=6, n_shared_experts=2)
DS_QUICK_SHAPE = dict(DS_SHAPE, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=192,
                      kv_lora_rank=128,
                      qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8)
ARCHS = {"glm4moe": (SHAPE, QUICK_SHAPE, "GLM-4.5"), "deepseek2": (DS_SHAPE, DS_QUICK_SHAPE, "DeepSeek-V2-Lite-shaped")}


def build_checkpoint(out: Path, shape: dict, seed: int = 0, arch: str = "glm4moe") -> dict:
    """The random GLM-4.5 (or DeepSeek, arch deepseek2) checkpoint (bf16 safetensors) and its tokenizer, written
    to out."""
    import torch
    from tokenizers import AddedToken, Tokenizer

    from edgeinfer.backend.model.gguf_import import ensure_default_model
    from tests.support.hf_compat import hide_hub_kernels

    hide_hub_kernels()
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

    smol = ensure_default_model()
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(smol / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    shutil.copy2(smol / "tokenizer_config.json", out / "tokenizer_config.json")
    if arch == "deepseek2":
        cfg = DeepseekV3Config(vocab_size=tok.get_vocab_size(), n_group=1, topk_group=1, first_k_dense_replace=1,
                               routed_scaling_factor=1.0, norm_topk_prob=False, num_nextn_predict_layers=0,
                               tie_word_embeddings=True, max_position_embeddings=4096, **shape)
    else:
        cfg = Glm4MoeConfig(vocab_size=tok.get_vocab_size(), n_group=1, topk_group=1, first_k_dense_replace=1,
                            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                            attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=0,
                            tie_word_embeddings=True, max_position_embeddings=4096, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
    model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    sparse = cfg.num_hidden_layers - cfg.first_k_dense_replace
    active = params - sparse * per_expert * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    return {"parameters": params, "active_parameters_per_token": active, "config": cfg.to_dict()}


def make_gguf(hf_dir: Path, work: Path, src: Path, build: Path, stem: str = "glm45-moe") -> Path:
    """llama.cpp's converter (f16), then llama-quantize to Q4_0 with a Q8_0 token embedding."""
    f16, q4 = work / f"{stem}-f16.gguf", work / f"{stem}-q4_0.gguf"
    if not f16.exists():
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(f16),
                        "--outtype", "f16"], check=True, env=env)
    if not q4.exists():
        quantize = find_binary("llama-quantize", build)
        if quantize is None:
            raise SystemExit(f"no llama-quantize under {build}")
        subprocess.run([str(quantize), "--token-embedding-type", "q8_0", str(f16), str(q4), "Q4_0"], check=True,
                       stdout=subprocess.DEVNULL)
    return q4


def gguf_types(path: Path) -> dict[str, int]:
    import gguf

    counts: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def model_steps(model_dir: Path, levels: list[int], threads: int, steps: int = 12, context: int = 31) -> dict:
    """edgeinfer's model alone, in this process (no server, scheduler or HTTP): ms per decode step of `b` sequences
    at context + 1 tokens of context, per activation mode (each in a fresh subprocess: the mode is read at
    prepack)."""
    code = f"""
import json, sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
torch.set_num_threads({threads})
from edgeinfer.backend.model.loader import load_model
from tests.support.dense import decode_batch
m = load_model({str(model_dir)!r})
out = {{}}
for b in {levels!r}:
    kv, pos, meta = decode_batch(m, b, {context})
    ids = torch.randint(100, 40000, (b,), generator=torch.Generator().manual_seed(b))
    for _ in range(3):
        m.compute_logits(m(ids, pos, kv, meta))
    t = time.perf_counter()
    for _ in range({steps}):
        m.compute_logits(m(ids, pos, kv, meta))
    out[str(b)] = round((time.perf_counter() - t) / {steps} * 1000, 2)
print(json.dumps(out))
"""
    res: dict = {}
    for acts in ("int8x2", "int8"):
        env = {**os.environ, "EDGEINFER_CPU_ACTIVATIONS": acts, "OMP_NUM_THREADS": str(threads)}
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            res[acts] = {"error": p.stderr[-2000:]}
            continue
        ms = json.loads(p.stdout.strip().splitlines()[-1])
        res[acts] = {"step_ms": ms, "tok_s": {b: round(int(b) / v * 1000, 1) for b, v in ms.items()}}
    return res


def llama_bench_raw(build: Path, gguf_path: Path, threads: int) -> dict:
    """llama.cpp's own llama-bench on the same file: pp512 and tg64 (batch-1 decode without a server)."""
    from benchmarks.harness.llamacpp import llama_bench

    binary = find_binary("llama-bench", build)
    if binary is None:
        return {"error": f"no llama-bench under {build}"}
    try:
        return llama_bench(binary, build, gguf_path, threads, 512, 64, 2, 900)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[-1000:]}


def summarize(runs: list[dict], levels: list[int]) -> dict:
    out: dict = {}
    for system in sorted({r["system"] for r in runs}):
        rs = [r for r in runs if r["system"] == system and "levels" in r]
        per: dict = {}
        for c in levels:
            rows = [x for r in rs for x in r["levels"] if x["concurrency"] == c]
            per[str(c)] = {k: (statistics.median(v) if (v := [x[k] for x in rows if x.get(k) is not None]) else None)
                           for k in ("decode_tok_s", "prefill_tok_s", "ttft_p50_ms")}
        peak = [r["memory"]["peak_rss_mib"] for r in rs if r.get("memory")]
        out[system] = {"levels": per, "peak_rss_mib": max(peak) if peak else None}
    return out


def ratios(summary: dict, levels: list[int]) -> dict:
    """{edgeinfer variant: {metric@level: edgeinfer / llama.cpp}}."""
    p = summary.get("llamacpp")
    out: dict = {}
    for name, e in summary.items():
        if name == "llamacpp" or not p:
            continue
        r = out[name] = {}
        for c in levels:
            for k in ("decode_tok_s", "prefill_tok_s"):
                a, b = e["levels"][str(c)][k], p["levels"][str(c)][k]
                r[f"{k}@{c}"] = round(a / b, 3) if a and b else None
        if e["peak_rss_mib"] and p["peak_rss_mib"]:
            r["peak_rss"] = round(e["peak_rss_mib"] / p["peak_rss_mib"], 3)
    return out


def goals(rat: dict, levels: list[int]) -> dict:
    out = {}
    for name, r in rat.items():
        if 1 in levels:
            x = r.get("decode_tok_s@1")
            out[f"{name}: batch-1 decode >= 1.0x llama.cpp"] = {"ratio": x, "met": x is not None and x >= 1.0}
        if 32 in levels:
            x = r.get("decode_tok_s@32")
            out[f"{name}: 32-sequence decode >= 2x llama.cpp"] = {"ratio": x, "met": x is not None and x >= 2.0}
    return out


def markdown(summary: dict, rat: dict, gl: dict, levels: list[int], title: str) -> str:
    lines = [f"# bench_moe: {title}", "", "| metric | " + " | ".join(f"c={c}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for system in summary:
        for k in ("decode_tok_s", "prefill_tok_s"):
            cells = [summary[system]["levels"][str(c)][k] for c in levels]
            lines.append(f"| {system} {k} | " + " | ".join("-" if x is None else f"{x:.1f}" for x in cells) + " |")
    for name, r in rat.items():
        for k in ("decode_tok_s", "prefill_tok_s"):
            cells = [r.get(f"{k}@{c}") for c in levels]
            lines.append(f"| {name} / llama.cpp {k} | " + " | ".join("-" if x is None else f"{x:.2f}x" for x in cells)
                         + " |")
    lines += ["", "| peak RSS MiB | " + " | ".join(f"{s}: {v['peak_rss_mib']}" for s, v in summary.items()) + " |",
              "", *(f"- {g}: {v['ratio']} -> {'met' if v['met'] else 'MISSED'}" for g, v in gl.items())]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 layers of 16 experts, 1 round, levels 1,8, 16 tokens")
    p.add_argument("--arch", choices=sorted(ARCHS), default="glm4moe",
                   help="glm4moe (default) or deepseek2 (MLA: benchmarks/mla_peer.py)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--levels", default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--llamacpp-src", type=Path, default=None,
                   help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py); default: the sdist bench_peers "
                        "--install unpacks beside --llamacpp-build")
    p.add_argument("--llamacpp-build", type=Path, default=PEERS_HOME / "llama-build")
    p.add_argument("--work", type=Path, default=PEERS_HOME / "bench_moe")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--no-raw", dest="raw", action="store_false",
                   help="skip the in-process model step timing and llama-bench")
    p.add_argument("--also-activations", default="int8",
                   help="comma list of EDGEINFER_CPU_ACTIVATIONS modes to run as extra edgeinfer systems besides the "
                        "default (int8x2); int8 is one int8 pass, as llama.cpp's Q8 activations ('' for none)")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false",
                   help="edgeinfer alone, on our own RTN INT4 quantization of the same checkpoint (no llama.cpp "
                        "tools needed: the smoke run); no ratios")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "moe.json")
    a = p.parse_args(argv)
    a.levels = [int(x) for x in (a.levels or ("1,8" if a.quick else "1,8,32")).split(",")]
    a.also_activations = [m for m in a.also_activations.split(",") if m]
    if bad := [m for m in a.also_activations if m not in ("int8", "int8x2")]:
        p.error(f"--also-activations: unknown {bad}; expected int8 or int8x2")
    a.rounds = a.rounds or (1 if a.quick else 2)
    a.max_tokens = a.max_tokens or (16 if a.quick else 64)
    if a.quick:
        a.prefill_len = min(a.prefill_len, 128)
    if a.llamacpp_src is None:
        found = sorted((a.llamacpp_build.parent / f"{a.llamacpp_build.name}-src").glob("*/vendor/llama.cpp"))
        a.llamacpp_src = found[-1] if found else None
    if a.llamacpp and (a.llamacpp_src is None or not (a.llamacpp_src / "convert_hf_to_gguf.py").is_file()):
        p.error(f"--llamacpp-src: no convert_hf_to_gguf.py in {a.llamacpp_src} (a llama.cpp source tree)")
    return a


def plan_ab(work: Path, threads: int, out: Path) -> int:
    import torch

    from edgeinfer.backend.model.gguf_import import default_gguf_path, ensure_default_model, import_gguf
    from edgeinfer.backend.model.loader import load_model
    from tests.support import moe_checkpoints
    from tests.support.dense import decode_batch

    t0, load0 = time.monotonic(), os.getloadavg()
    torch.set_num_threads(threads)
    native = work / "plan_ab" / "native"
    if not (native / "config.json").exists():
        shape = {k: v for k, v in SHAPE.items()} | dict(n_group=1, topk_group=1, tie_word_embeddings=True,
                                                          max_position_embeddings=4096)
        hf = moe_checkpoints.servable("glm4_moe", work / "plan_ab" / "hf", ensure_default_model(), **shape)
        src = moe_checkpoints.write_moe_gguf(hf, work / "plan_ab" / "q4_0.gguf", default_gguf_path(), quant="Q4_0")
        del hf
        import_gguf(src, native, native=True, progress=False)
    m = load_model(native)
    if m._decode_plan is None:
        raise SystemExit("no decode plan for this model (not the native CPU path?)")
    result: dict = {"bench": "moe.plan_ab", "shape": SHAPE, "threads": threads, "context": 64, "levels": {}}
    with torch.inference_mode():
        for b in (1, 8, 32):
            kv, pos, meta = decode_batch(m, b, 63)
            ids = torch.randint(100, 40000, (b,), generator=torch.Generator().manual_seed(b))
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(6):
                for lean in ((True, False) if r % 2 == 0 else (False, True)):
                    m.lean_decode = lean
                    for _ in range(2):
                        m.compute_logits(m(ids, pos, kv, meta))
                    t = time.perf_counter()
                    for _ in range(8):
                        m.compute_logits(m(ids, pos, kv, meta))
                    times[lean].append((time.perf_counter() - t) / 8 * 1e3)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            result["levels"][str(b)] = {"plan_ms": round(on, 2), "modules_ms": round(off, 2),
                                        "plan_speedup": round(off / on, 3)}
            say(f"{b} sequences: plan {on:.2f} ms, modules {off:.2f} ms per step ({off / on:.2f}x)")
    result.update(run_stamp(t0, load0))
    write_result(result, out, echo=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--plan-ab" in argv:
        rest = [x for x in argv if x != "--plan-ab"]
        work = Path(rest[rest.index("--work") + 1]) if "--work" in rest else PEERS_HOME / "bench_moe"
        return plan_ab(work, 2, ROOT / "benchmarks" / "results" / "moe.plan_ab.json")
    t0, load0 = time.monotonic(), os.getloadavg()
    a = parse_args(argv)
    full_shape, quick_shape, family = ARCHS[a.arch]
    shape = quick_shape if a.quick else full_shape
    work = a.work / (("quick" if a.quick else "full") + ("" if a.arch == "glm4moe" else f"-{a.arch}"))
    stem = "glm45-moe" if a.arch == "glm4moe" else a.arch
    hf_dir = work / "hf"
    model_info: dict = {}
    if not (hf_dir / "config.json").exists():
        say(f"building the random {family} checkpoint in {hf_dir}")
        model_info = build_checkpoint(hf_dir, shape, arch=a.arch)
        (work / "model_info.json").write_text(json.dumps(model_info, indent=2))
    else:
        model_info = json.loads((work / "model_info.json").read_text())
    say(f"{model_info['parameters'] / 1e6:.0f}M parameters, {model_info['active_parameters_per_token'] / 1e6:.0f}M "
        "active per token; " + ("converting with llama.cpp's tools" if a.llamacpp else "quantizing (RTN, INT4)"))
    gguf_path: Path | None = None
    if a.llamacpp:
        gguf_path = make_gguf(hf_dir, work, a.llamacpp_src, a.llamacpp_build, stem)
        native = work / "edgeinfer" / f"{stem}-q4_0"
        if not (native / "config.json").exists():
            from edgeinfer.backend.model.gguf_import import import_gguf

            import_gguf(gguf_path, native, native=True)
    else:
        native = work / "edgeinfer" / f"{stem}-rtn-w4a16-g32"
        if not (native / "config.json").exists():
            from edgeinfer.backend.quant.quantize import quantize_checkpoint

            quantize_checkpoint(hf_dir, native, scheme="w4a16-g32", method="rtn", progress=False)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(native / "tokenizer.json"))
    ids = prompt_tokens(tok)
    slots, ctx = max(a.levels), max(a.prefill_len + 8, a.decode_prompt_len + a.max_tokens + 8)
    log_dir = work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def spec(name: str, rnd: int) -> ServerSpec:
        if name.startswith("edgeinfer"):   # a fresh home per run: an empty page store, nothing earlier hits
            home = work / f"home-{rnd}"
            shutil.rmtree(home, ignore_errors=True)
            s = edgeinfer_spec(a.threads, native, home)
            acts = name.partition("-")[2] or "int8x2"
            return replace(s, name=name, env={**s.env, "EDGEINFER_CPU_ACTIVATIONS": acts},
                           notes={**s.notes, "activations": acts})
        assert gguf_path is not None
        return llamacpp_spec(a.threads, gguf_path, a.llamacpp_build, PEERS_HOME / "llamacpp", slots, ctx)

    la = SimpleNamespace(levels=a.levels, decode_prompt_len=a.decode_prompt_len, prefill_len=a.prefill_len,
                         max_tokens=a.max_tokens, request_timeout=a.request_timeout, mixed_range=None)
    runs: list[dict] = []
    systems = ["edgeinfer", *(f"edgeinfer-{m}" for m in a.also_activations), *(["llamacpp"] if a.llamacpp else [])]
    for rnd, name in interleaved(systems, a.rounds):
        s = spec(name, rnd)
        say(f"round {rnd + 1}/{a.rounds}: {name}")
        run: dict = {"round": rnd + 1, "system": name, "command": s.cmd}
        try:
            with Running(s, log_dir, a.ready_timeout) as srv:
                run["startup_s"] = round(srv.startup_s, 1)
                run["levels"] = run_levels(srv, la, Prompts(ids, rnd), tok)
            run["memory"] = srv.memory
            say(f"  {name}: peak RSS {run['memory'].get('peak_rss_mib')} MiB")
        except (RuntimeError, TimeoutError) as e:
            run["error"] = str(e)[-3000:]
            say(f"  {name} FAILED: {str(e)[:500]}")
        runs.append(run)
    raw: dict = {}
    if a.raw:
        say("raw engines: edgeinfer's model alone per activation mode, llama-bench")
        raw = {"edgeinfer_model_step": model_steps(native, a.levels, a.threads,
                                                   context=max(a.decode_prompt_len - 1, 31)),
               "llama_bench": llama_bench_raw(a.llamacpp_build, gguf_path, a.threads) if gguf_path else {}}
        tg = [r["tok_s"] for r in raw["llama_bench"].get("rows", []) if r["test"] == "tg64"]
        for acts, r in raw["edgeinfer_model_step"].items():
            if tg and "tok_s" in r and "1" in r["tok_s"]:
                raw[f"batch-1 model step {acts} / llama-bench tg64"] = round(r["tok_s"]["1"] / tg[0], 3)
        say(f"  {json.dumps({k: v for k, v in raw.items() if k != 'llama_bench'})}")
    summary = summarize(runs, a.levels)
    rat = ratios(summary, a.levels)
    gl = goals(rat, a.levels)
    md = markdown(summary, rat, gl, a.levels, f"{model_info['parameters'] / 1e6:.0f}M-parameter random {family} "
                  f"MoE, Q4_0, {a.threads} threads, {a.max_tokens} tokens/request, {a.rounds} round(s), medians; "
                  f"{platform.node()} ({os.cpu_count()} CPUs)")
    print(md)
    result = {"bench": "bench_moe", "arch": a.arch, "quick": a.quick, "host": platform.node(), "cpus": os.cpu_count(),
              "threads": a.threads, "levels": a.levels, "rounds": a.rounds, "max_tokens": a.max_tokens,
              "prefill_len": a.prefill_len, "decode_prompt_len": a.decode_prompt_len, "model": model_info | {
                  "config": {k: model_info["config"].get(k) for k in (*full_shape, "first_k_dense_replace",
                                                                       "n_shared_experts", "tie_word_embeddings")}},
              "gguf": str(gguf_path) if gguf_path else None,
              "gguf_tensor_types": gguf_types(gguf_path) if gguf_path else None, "summary": summary, "ratios": rat,
              "goals": gl, "raw": raw, "runs": runs, **run_stamp(t0, load0)}
    write_result(result, a.out, echo=False)
    a.out.with_suffix(".md").write_text(md)
    say(f"wrote {a.out}")
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
