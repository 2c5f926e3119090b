"""Does the served default answer what its own weights answer? Greedy chat answers over 100 short prompts, the
served model (backend.server's defaults: the GGUF's Q4_1 blocks on the CPU kernels, int8 activations) against
the same GGUF dequantized to fp32, and llama.cpp's Q4_1 against llama.cpp's F32 of the same GGUF, in one run.

  python -m benchmarks quality.chat_agreement [--max-tokens 32] [--kv-dtype auto] [--variants served,torch_int4]
      [--llamacpp-build /work/peers/llama-build] [--out benchmarks/results/quality.chat_agreement.json]

The prompts (benchmarks/data/chat_prompts.txt) go through the model's own chat template (one user turn) and
are the same token ids on every side (llama-server gets them as a token list). Greedy, at most --max-tokens
tokens, stopping at EOS. Per pair (candidate, reference):
  same answer     the two token sequences are identical
  same first      the first answer token is the same
  common prefix   mean fraction of the reference's tokens before the first difference
Variants of ours: `served` (the default: activations in two int8 passes), `int8` (one int8 pass, as
llama.cpp's Q8_1: EDGEINFER_CPU_ACTIVATIONS=int8), `torch_int4` (EDGEINFER_CPU_KERNELS=torch: torch's int4 GEMM, fp32
activations), `fp32kv` / `bf16kv` / `int8kv` / `fp8kv` (served with that --kv-dtype), `x2@T` (two passes, the second only on the blocks whose scale is at
least T times the row's largest: EDGEINFER_CPU_SECOND_PASS=T; x2@0 is every block). llama.cpp needs llama-server and llama-quantize in
--llamacpp-build (its F32 GGUF is made once beside the results with `llama-quantize --allow-requantize`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.results import run_stamp, write_result  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "chat_prompts.txt"
OUT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "quality.chat_agreement.json"


def prompts() -> list[str]:
    return [ln.strip() for ln in PROMPTS.read_text().splitlines() if ln.strip()]


def compare(cand: list[list[int]], ref: list[list[int]]) -> dict:
    same = sum(c == r for c, r in zip(cand, ref))
    first = sum(bool(c and r and c[0] == r[0]) for c, r in zip(cand, ref))
    prefix = []
    for c, r in zip(cand, ref):
        n = next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), min(len(c), len(r)))
        prefix.append(n / max(len(r), 1) if c != r else 1.0)
    n = len(ref)
    return {"same_answer": same / n, "same_first_token": first / n, "common_prefix": sum(prefix) / n,
            "different": [i for i, (c, r) in enumerate(zip(cand, ref)) if c != r]}


async def _engine_answers(eng, ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    async def one(i: int, p: list[int]) -> list[int]:
        out: list[int] = []
        req = GenerateRequest(f"agree-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0), f"ns{i}")
        async for chunk in eng.generate(req):
            out.extend(chunk.token_ids)
        return out

    return list(await asyncio.gather(*[one(i, p) for i, p in enumerate(ids)]))


def engine_answers(eng, ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    eng.start()
    try:
        return asyncio.run(_engine_answers(eng, ids, max_tokens))
    finally:
        eng.stop()


def ours(variant: str, ids: list[list[int]], max_tokens: int, kv_dtype: str) -> tuple[list[list[int]], dict]:
    """One variant in a subprocess (its env and torch state its own); returns answers and what it ran."""
    env = dict(os.environ)
    if variant == "torch_int4":
        env["EDGEINFER_CPU_KERNELS"] = "torch"
    if variant == "int8":
        env["EDGEINFER_CPU_ACTIVATIONS"] = "int8"
    if variant.startswith("x2@"):   # two int8 passes, the second on the blocks of scale >= T x the row's largest
        env["EDGEINFER_CPU_ACTIVATIONS"], env["EDGEINFER_CPU_SECOND_PASS"] = "int8x2", variant[3:]
    kv = {"fp32kv": "fp32", "bf16kv": "bf16", "int8kv": "int8", "fp8kv": "fp8_e4m3"}.get(variant, kv_dtype)
    code = ("import json,sys; from benchmarks.quality.chat_agreement import _child; "
            f"print(json.dumps(_child({variant!r}, {kv!r}, {max_tokens}, json.loads(sys.stdin.read()))))")
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(ids), capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out.pop("answers"), out


def _child(variant: str, kv_dtype: str, max_tokens: int, ids: list[list[int]]) -> dict:
    from edgeinfer.backend.server import build_state, parse_args

    argv = ["--store-tier", "none", "--log-level", "WARNING", "--insecure-no-internal-auth", "--kv-dtype", kv_dtype]
    if variant == "reference":
        from edgeinfer.backend.model.gguf_import import ensure_default_model

        argv += ["--model", str(ensure_default_model())]
    eng = build_state(parse_args(argv)).engine
    t = time.monotonic()
    answers = engine_answers(eng, ids, max_tokens)
    return {"answers": answers, "kv_format": eng.kv_format, "model_dir": eng.model_name,
            "seconds": round(time.monotonic() - t, 1)}


def chat_ids(texts: list[str]) -> tuple[list[list[int]], object]:
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.protocol.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ensure_native_default_model())
    return [list(tok.encode_chat([{"role": "user", "content": t}])) for t in texts], tok


def llamacpp_answers(build: Path, gguf: Path, ids: list[list[int]], max_tokens: int, threads: int) -> list[list[int]]:
    from benchmarks.harness.servers import find_binary
    from tests.support.redis_server import free_port

    server = find_binary("llama-server", build, build / "bin")
    if server is None:
        raise RuntimeError(f"no llama-server under {build}")
    port = free_port()
    proc = subprocess.Popen([str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t",
                             str(threads), "-c", "2048", "-np", "1", "-ctk", "f32", "-ctv", "f32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server on {gguf.name} did not start")
            time.sleep(0.5)
        out = []
        for p in ids:
            body = json.dumps({"prompt": p, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                               "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                out.append([int(t) for t in json.loads(r.read())["tokens"]])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def f32_gguf(build: Path, src: Path, dst: Path) -> Path:
    if not dst.exists():
        from benchmarks.harness.servers import find_binary

        quant = find_binary("llama-quantize", build, build / "bin")
        if quant is None:
            raise RuntimeError(f"no llama-quantize under {build}")
        subprocess.run([str(quant), "--allow-requantize", str(src), str(dst), "F32", "1"], check=True,
                       capture_output=True)
    return dst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-dtype", default="auto", help="the variants' KV dtype (default auto: what the gate serves)")
    ap.add_argument("--variants", default="served,int8,torch_int4")
    ap.add_argument("--llamacpp-build", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (a smoke run)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    t0, load0 = time.monotonic(), os.getloadavg()
    texts = prompts()[: a.limit or None]
    ids, tok = chat_ids(texts)
    ref, ref_info = ours("reference", ids, a.max_tokens, "fp32")
    result: dict = {"prompts": len(texts), "max_tokens": a.max_tokens,
                    "reference": {"what": "GGUF dequantized to fp32, fp32 KV, this engine", **ref_info},
                    "ours": {}, "examples": []}
    answers = {"reference": ref}
    for v in [x for x in a.variants.split(",") if x]:
        got, info = ours(v, ids, a.max_tokens, a.kv_dtype)
        answers[v] = got
        result["ours"][v] = {**info, **compare(got, ref)}
        print(f"{v:>12} vs fp32 reference: {result['ours'][v]['same_answer']:.0%} same answer, "
              f"{result['ours'][v]['same_first_token']:.0%} same first token, "
              f"common prefix {result['ours'][v]['common_prefix']:.3f}", flush=True)
    if a.llamacpp_build:
        from edgeinfer.backend.model.gguf_import import default_gguf_path

        q = default_gguf_path()
        f32 = f32_gguf(a.llamacpp_build, q, a.llamacpp_build / "smollm2_f32.gguf")
        lq = llamacpp_answers(a.llamacpp_build, q, ids, a.max_tokens, a.threads)
        lf = llamacpp_answers(a.llamacpp_build, f32, ids, a.max_tokens, a.threads)
        answers["llamacpp_q4_1"], answers["llamacpp_f32"] = lq, lf
        result["llamacpp"] = {"q4_1_vs_f32": compare(lq, lf), "f32_vs_our_reference": compare(lf, ref)}
        print(f"{'llama.cpp':>12} Q4_1 vs its F32: {result['llamacpp']['q4_1_vs_f32']['same_answer']:.0%} same "
              f"answer, {result['llamacpp']['q4_1_vs_f32']['same_first_token']:.0%} same first token, common "
              f"prefix {result['llamacpp']['q4_1_vs_f32']['common_prefix']:.3f}; its F32 vs our fp32: "
              f"{result['llamacpp']['f32_vs_our_reference']['same_answer']:.0%} same", flush=True)
    for i in range(min(len(texts), 100)):
        if any(answers[k][i] != ref[i] for k in answers):
            result["examples"].append({"prompt": texts[i], **{k: tok.decode(v[i]) for k, v in answers.items()}})
    result.update(run_stamp(t0, load0))
    write_result(result, a.out, echo=False)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
