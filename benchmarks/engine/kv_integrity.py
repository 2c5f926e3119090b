"""What KV integrity inside the engine costs (backend/engine/kv_integrity.py), on the default model as served
(`edgeinfer serve`'s backend flags: INT4 weights, fp8 KV), measured side by side on one engine.

Decode: B sequences (prompt --prompt-len) decode on the caller's thread; rounds alternate the checks on (the
default: stamps checked before every step, sealed pages checksummed) and off (`--no-kv-integrity`), the order
reversed every other round, --steps decode steps each (every sequence seals a page each 16 steps). Reported per
B: decode tok/s on and off (medians over rounds) and the median of the per-round ratios on / off.

Prefix hit: a prompt of --hit-len tokens is served once (its pages sealed, checksummed); the same prompt is then
served again (1 token) with the checks on (every reused page's checksum verified: kv_verify_fraction 1) and off,
alternated; reported: time to first token of the hit, on and off, and the verification's own time per page.
Parts, at each B: the per-step identity check and the checksum of one page, timed alone, and the fraction of a
step they make (check + checksum x B / page_size pages sealed per step, over the step time with the checks off):
the cost without the A/B's noise (single rounds move a few % on this shared VM).

  python -m benchmarks engine.kv_integrity [--levels 1,8,32] [--steps 32] [--rounds 10] [--prompt-len 256]
                                           [--hit-len 2048] [--out F]
Writes benchmarks/results/engine.kv_integrity.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from benchmarks.engine.step import submit_greedy
from benchmarks.harness.results import ROOT, interleaved, run_stamp, write_result

OUT = ROOT / "benchmarks" / "results" / "engine.kv_integrity.json"


def served_config(num_pages: int, max_num_seqs: int):
    """The engine configuration `edgeinfer serve` gives its backend (its flags' defaults), with this run's pool."""
    from edgeinfer.backend.server import parse_args

    cfg = parse_args(["--insecure-no-internal-auth"]).engine_config()
    return dataclasses.replace(cfg, num_pages=num_pages, max_num_seqs=max_num_seqs, adaptive_threads=False)


def decode_level(model, batch: int, args) -> dict:
    from edgeinfer.backend.engine.engine import LLMEngine

    total = args.prompt_len + 8 + args.rounds * 2 * args.steps
    pages = batch * (-(-total // 16) + 1) + 8
    eng = LLMEngine(model, None, served_config(pages, max(batch, 8)))
    integrity = eng.integrity
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        submit_greedy(eng, f"b{i}", torch.randint(100, 49000, (args.prompt_len,), generator=g).tolist(), 100_000)
    while any(s.is_prefilling for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(4):
        eng.step()
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _, side in interleaved(["on", "off"], args.rounds):
        eng.set_kv_integrity(side == "on")
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        times[side].append(time.perf_counter() - t0)
    eng.set_kv_integrity(True)
    seqs = list(eng.scheduler.running)          # the parts alone: what the checks add to a step, without its noise
    t0 = time.perf_counter()
    for _ in range(200):
        integrity.check_batch(seqs)
    check_us = (time.perf_counter() - t0) / 200 * 1e6
    page = seqs[0].block_table[0]
    t0 = time.perf_counter()
    for _ in range(200):
        integrity.checksums([page])
    sum_us = (time.perf_counter() - t0) / 200 * 1e6
    step_us = statistics.median(times["off"]) / args.steps * 1e6
    tok = {k: [batch * args.steps / t for t in v] for k, v in times.items()}
    ratios = [b / a for a, b in zip(times["on"], times["off"])]   # (tok/s on) / (tok/s off) per round
    return {"decode_tok_s_on": round(statistics.median(tok["on"]), 1),
            "decode_tok_s_off": round(statistics.median(tok["off"]), 1),
            "on_over_off": round(statistics.median(ratios), 4),
            "on_over_off_rounds": [round(r, 4) for r in ratios],
            "step_ms_off": round(step_us / 1e3, 3),
            "identity_check_us_per_step": round(check_us, 1),
            "identity_checks_per_step": int(sum(len(s.block_table) for s in seqs)),
            "checksum_us_per_page": round(sum_us, 1), "page_bytes": eng.runner.page_bytes,
            # a step seals batch / page_size pages on average (one per sequence every page_size tokens)
            "parts_cost_fraction": round((check_us + sum_us * batch / eng.cfg.page_size) / step_us, 5),
            "sealed_pages_checksummed": len(integrity.ledger.checksum)}


def prefix_hit(model, args) -> dict:
    from edgeinfer.backend.engine.engine import LLMEngine
    from edgeinfer.protocol.page_id import page_hashes

    eng = LLMEngine(model, None, served_config(-(-args.hit_len // 16) * 3 + 16, 8))
    integrity = eng.integrity
    ids = torch.randint(100, 49000, (args.hit_len,), generator=torch.Generator().manual_seed(7)).tolist()
    seq = submit_greedy(eng, "cold", ids, 1)
    while eng.scheduler.has_work:
        eng.step()
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    for rnd, side in interleaved(["on", "off"], max(args.rounds, 2)):
        eng.set_kv_integrity(side == "on")
        t0 = time.perf_counter()
        seq = submit_greedy(eng, f"hit-{rnd}-{side}", ids, 1)
        while eng.scheduler.has_work:
            eng.step()
        ttft[side].append(time.perf_counter() - t0)
        assert seq.num_cached_prompt_tokens > 0
    eng.set_kv_integrity(True)
    hashes = page_hashes(eng.key_context("bench"), ids)
    pages = [eng.blocks.cache[h].page for h in hashes if h in eng.blocks.cache]
    t0 = time.perf_counter()
    for _ in range(5):
        assert integrity.verify(pages, hashes[:len(pages)], "prefix_hit") == len(pages)
    per_page = (time.perf_counter() - t0) / 5 / max(len(pages), 1)
    on, off = statistics.median(ttft["on"]), statistics.median(ttft["off"])
    return {"prompt_tokens": args.hit_len, "pages_reused": len(pages), "hit_ttft_ms_on": round(on * 1e3, 2),
            "hit_ttft_ms_off": round(off * 1e3, 2), "hit_ttft_on_over_off": round(on / off, 4),
            "verify_us_per_page": round(per_page * 1e6, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks engine.kv_integrity", description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--hit-len", type=int, default=2048)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    t0, load0 = time.monotonic(), os.getloadavg()
    from edgeinfer.backend.engine.loading import in_fresh_thread
    from edgeinfer.backend.model.gguf_import import ensure_native_default_model
    from edgeinfer.backend.model.loader import load_model

    torch.set_grad_enabled(False)
    model_dir = ensure_native_default_model()
    model = in_fresh_thread(load_model, model_dir)
    levels = {str(b): decode_level(model, b, args) for b in args.levels}
    hit = prefix_hit(model, args)
    top = levels[str(max(args.levels))]
    cost = 1 - top["on_over_off"]
    result = {
        "benchmark": "engine.kv_integrity",
        "model": str(model_dir.name), "kv_dtype": served_config(1, 1).kv_dtype, "threads": torch.get_num_threads(),
        "settings": {"levels": args.levels, "steps": args.steps, "rounds": args.rounds, "prompt_len": args.prompt_len,
                     "hit_len": args.hit_len},
        "decode": levels, "prefix_hit": hit,
        "decode_cost_at_top_level": round(cost, 4),
        "parts_cost_at_top_level": top["parts_cost_fraction"],
        "on_by_default": cost <= 0.02,
        "run": run_stamp(t0, load0),
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
