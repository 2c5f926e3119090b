"""Shared prefix cache benchmarks, measured side by side in one run.

    python -m benchmarks cache [--quick]

1. Page tag (the keyed MAC, codec.PageKey: AES-256-GMAC under a one-page key) + verify throughput vs a plain
   memory copy of the same bytes, for a SmolLM2-135M page (30 layers, 3 kv heads, head_dim 64, 16 tokens)
   in bf16 and in fp8 e4m3 with per-(layer, k/v, head) fp32 scales. Side by side, the same bytes through
   the alternatives: unkeyed xxh3-64 (the old tag), keyed BLAKE2b, HMAC-SHA256.
2. Tag + verify time as a share of moving the page through a real
   valkey-server on loopback (the cheapest "transfer" a page can have).
3. Redis round trips per prefix lookup (1k and 4k token prompts), single
   server and 3-node cluster.
4. TTFT for a 1k- and a 4k-token prompt, cold vs a cross-node hit: two LLMEngines in this process, each
   with its own KV pool and its own PageStoreBridge (host tier + Redis tier, the backend's default), sharing
   one valkey-server. A prefills the prompt (cold) and publishes its pages; B then serves the same prompt
   in the same namespace, fetching + verifying + uploading the pages (cross-node hit; B's local cache is
   dropped before each repeat so every repeat is a cross-node hit); B also runs it cold in a fresh
   namespace. TTFT = before_generate (the fetch) + time to the first token. Also the Redis round trips of
   each request's fetch. (--skip-ttft to leave it out.)

Writes benchmarks/results/cache.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hashlib  # noqa: E402
import hmac  # noqa: E402

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from edgeinfer.cache_store.codec import (  # noqa: E402
    MAC_BYTES,
    SALT_BYTES,
    DecodedPage,
    PageFormat,
    PageKey,
    decode,
    encode,
)
from edgeinfer.cache_store.index import RedisPageIndex  # noqa: E402
from edgeinfer.cache_store.resilience import RedisGuard, redis_client  # noqa: E402
from edgeinfer.cache_store.store import RedisPageStore  # noqa: E402
from edgeinfer.protocol.page_id import PageKeyContext, page_hashes  # noqa: E402
from tests.support.redis_server import ValkeyCluster, ValkeyServer  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16
RESULTS = ROOT / "benchmarks" / "results" / "cache.json"
KEY = PageKey.from_secret(b"bench-cache-page-key")


def page_formats() -> dict[str, tuple[PageFormat, int]]:
    elems = LAYERS * 2 * KV_HEADS * HEAD_DIM * PAGE
    scales = LAYERS * 2 * KV_HEADS * 4
    common = dict(model_fingerprint="smollm2-135m", num_layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  page_size=PAGE)
    return {
        "bf16": (PageFormat(kv_dtype="bfloat16", **common), elems * 2),
        "fp8_e4m3": (PageFormat(kv_dtype="float8_e4m3fn", scale_layout="per_layer_kv_head_f32", **common),
                     elems + scales),
    }


def best_seconds(fn, min_total_s: float) -> float:
    """Median per-call seconds over repeated batches; batches sized to ~min_total_s/7 each."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.02:
        fn()
        n += 1
    per_batch = max(1, int(n * (min_total_s / 7) / 0.02))
    samples = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t) / per_batch)
    return statistics.median(samples)


def bench_codec(quick: bool) -> dict:
    out = {}
    rng = np.random.default_rng(0)
    budget = 0.3 if quick else 1.0
    for name, (fmt, nbytes) in page_formats().items():
        body = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
        tokens = list(range(PAGE))
        h, parent = b"h" * 16, b"p" * 16
        header = fmt.header(h, parent, tokens)
        expect = fmt.expect(h, parent, tokens)
        blob = encode(header, body, KEY)
        assert isinstance(decode(blob, expect, KEY), DecodedPage)
        dst = bytearray(len(blob))
        sealed = memoryview(blob)[:-MAC_BYTES]
        salt = bytes(sealed[-SALT_BYTES:])
        bkey = os.urandom(32)
        t_copy_alloc = best_seconds(lambda body=body: bytearray(body), budget)
        t_copy_into = best_seconds(lambda dst=dst, blob=blob: dst.__setitem__(slice(None), blob), budget)
        t_hash = best_seconds(lambda blob=blob: xxhash.xxh3_64_intdigest(blob), budget)
        t_mac = best_seconds(lambda salt=salt, sealed=sealed: KEY.mac(salt, sealed), budget)
        t_blake = best_seconds(lambda sealed=sealed, bkey=bkey: hashlib.blake2b(sealed, key=bkey, digest_size=16).digest(),
                               budget)
        t_hmac = best_seconds(lambda sealed=sealed, bkey=bkey: hmac.digest(bkey, sealed, "sha256"), budget)
        t_encode = best_seconds(lambda header=header, body=body: encode(header, body, KEY), budget)
        t_decode = best_seconds(lambda blob=blob, expect=expect: decode(blob, expect, KEY), budget)
        gbps = lambda t, n=len(blob): n / t / 1e9  # noqa: E731
        out[name] = {
            "page_bytes": len(blob),
            "body_bytes": nbytes,
            "copy_alloc_us": t_copy_alloc * 1e6, "copy_alloc_GBps": gbps(t_copy_alloc),
            "copy_into_us": t_copy_into * 1e6, "copy_into_GBps": gbps(t_copy_into),
            "mac_us": t_mac * 1e6, "mac_GBps": gbps(t_mac), "mac": "aes-256-gmac, one-page key blake2b(key, salt)",
            "xxh3_64_us": t_hash * 1e6, "xxh3_64_GBps": gbps(t_hash),     # the old, unkeyed tag
            "blake2b_keyed_us": t_blake * 1e6, "blake2b_keyed_GBps": gbps(t_blake),
            "hmac_sha256_us": t_hmac * 1e6, "hmac_sha256_GBps": gbps(t_hmac),
            "encode_us": t_encode * 1e6, "encode_GBps": gbps(t_encode),
            "verify_us": t_decode * 1e6, "verify_GBps": gbps(t_decode),
            # tag (sender MACs) + verify (receiver MACs and parses) vs copying the same bytes once
            "tag_plus_verify_vs_copy": (t_mac + t_decode) / t_copy_alloc,
            "encode_vs_copy": t_encode / t_copy_alloc,
            "verify_vs_copy": t_decode / t_copy_alloc,
        }
    return out


async def bench_redis_transfer(url: str, quick: bool, codec_results: dict) -> dict:
    client = redis_client(url, socket_timeout_s=5)
    store = RedisPageStore(client, guard=RedisGuard(timeout_s=10), timeout_s=10)
    out = {}
    try:
        for name, (fmt, nbytes) in page_formats().items():
            n_pages = 16
            rng = np.random.default_rng(1)
            items, expects = [], []
            for i in range(n_pages):
                h = i.to_bytes(16, "little")
                items.append((h, encode(fmt.header(h, b"p" * 16, list(range(PAGE))),
                                        rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes(), KEY)))
                expects.append(fmt.expect(h, b"p" * 16, list(range(PAGE))))
            assert all(await store.put_many(items))
            keys = [h for h, _ in items]
            times = []
            for _ in range(5 if quick else 15):
                t = time.perf_counter()
                blobs = await store.get_many(keys)
                times.append(time.perf_counter() - t)
            assert all(isinstance(decode(b, e, KEY), DecodedPage) for b, e in zip(blobs, expects, strict=True))
            per_page = statistics.median(times) / n_pages
            c = codec_results[name]
            tag_verify_s = (c["mac_us"] + c["verify_us"]) / 1e6
            out[name] = {
                "pages_per_fetch": n_pages,
                "fetch_round_trips": 1,
                "redis_get_per_page_us": per_page * 1e6,
                "redis_get_GBps": c["page_bytes"] / per_page / 1e9,
                "tag_plus_verify_share_of_redis_get": tag_verify_s / per_page,
                # the same with the alternatives (tag + one more pass to verify), for comparison
                "xxh3_tag_plus_verify_share_of_redis_get": 2 * c["xxh3_64_us"] / 1e6 / per_page,
                "blake2b_keyed_tag_plus_verify_share_of_redis_get": 2 * c["blake2b_keyed_us"] / 1e6 / per_page,
                "hmac_sha256_tag_plus_verify_share_of_redis_get": 2 * c["hmac_sha256_us"] / 1e6 / per_page,
                # the fetch path only verifies; the tag was computed once, at publish time
                "verify_share_of_redis_get": c["verify_us"] / 1e6 / per_page,
            }
            await store.delete_many(keys)
    finally:
        await client.aclose()
    return out


async def bench_lookup(url: str, cluster: bool, quick: bool, server_side: bool = True) -> dict:
    client = redis_client(url, cluster=cluster, socket_timeout_s=5)
    if cluster:
        await client.initialize()
    await client.flushall()
    index = RedisPageIndex(client, guard=RedisGuard(timeout_s=5), server_side=server_side)
    ctx = PageKeyContext(seed=b"bench", namespace="tenant", model_fingerprint="smollm2-135m", kv_format="bf16")
    out = {}
    try:
        for tokens in (1024, 4096):
            hashes = page_hashes(ctx, list(range(tokens)))
            await index.publish("smollm2-135m", "node-a", hashes)
            await index.publish("smollm2-135m", "node-b", hashes[: len(hashes) // 2])
            lat, rts = [], []
            for _ in range(10 if quick else 50):
                before = index.round_trips
                t = time.perf_counter()
                got = await index.longest_prefix("smollm2-135m", hashes)
                lat.append(time.perf_counter() - t)
                rts.append(index.round_trips - before)
            assert got == {"node-a": len(hashes), "node-b": len(hashes) // 2}, got
            miss_before = index.round_trips
            await index.longest_prefix("smollm2-135m", page_hashes(
                PageKeyContext(seed=b"bench", namespace="other", model_fingerprint="x", kv_format="bf16"),
                list(range(tokens))))
            out[f"{tokens}_tokens"] = {
                "pages": len(hashes),
                "round_trips_hit": statistics.median(rts),
                "round_trips_miss": index.round_trips - miss_before,
                "lookup_ms_median": statistics.median(lat) * 1e3,
            }
    finally:
        await client.aclose()
    return out


def print_report(r: dict) -> None:
    print(f"\n== page tag+verify vs memory copy ({r['machine']['cpu']}) ==")
    for name, c in r["codec"].items():
        print(f"{name:9s} page {c['page_bytes'] / 1e3:7.1f} KB | copy {c['copy_alloc_us']:7.1f} us "
              f"({c['copy_alloc_GBps']:5.1f} GB/s) | mac {c['mac_us']:6.1f} us ({c['mac_GBps']:5.1f} GB/s)"
              f" | [xxh3 {c['xxh3_64_us']:6.1f} us, keyed blake2b {c['blake2b_keyed_us']:7.1f} us, "
              f"hmac-sha256 {c['hmac_sha256_us']:7.1f} us] | encode {c['encode_us']:7.1f} us | verify {c['verify_us']:6.1f} us"
              f" | (tag+verify)/copy = {c['tag_plus_verify_vs_copy']:.2f}x")
    print("\n== tag+verify share of a loopback valkey GET of the page ==")
    for name, t in r["redis_transfer"].items():
        print(f"{name:9s} GET {t['redis_get_per_page_us']:7.1f} us/page ({t['redis_get_GBps']:.2f} GB/s), "
              f"{t['pages_per_fetch']} pages in {t['fetch_round_trips']} round trip | "
              f"verify = {t['verify_share_of_redis_get'] * 100:.1f}%, "
              f"tag+verify = {t['tag_plus_verify_share_of_redis_get'] * 100:.1f}% of it (goal <= 5%) | "
              f"same for xxh3 {t['xxh3_tag_plus_verify_share_of_redis_get'] * 100:.1f}%, keyed blake2b "
              f"{t['blake2b_keyed_tag_plus_verify_share_of_redis_get'] * 100:.1f}%, hmac-sha256 "
              f"{t['hmac_sha256_tag_plus_verify_share_of_redis_get'] * 100:.1f}%")
    print("\n== redis round trips per prefix lookup ==")
    for mode, res in r["lookup"].items():
        for k, v in res.items():
            print(f"{mode:16s} {k:12s} {v['pages']:4d} pages: {v['round_trips_hit']:.0f} round trip(s) on a hit, "
                  f"{v['round_trips_miss']} on a miss, {v['lookup_ms_median']:.2f} ms median")
    t = r["ttft_cold_vs_cross_node_hit"]
    print("\n== TTFT cold vs cross-node hit (two engines in one process, own KV pools, one valkey) ==")
    if "status" in t:
        print(t["status"])
        return
    print(f"model {t['model']} {t['dtype']}, kv {t['kv_format']}, {t['page_bytes']} B/page, "
          f"threads {t['torch_threads']}")
    for k, v in t["prompts"].items():
        print(f"{k:>5s} tokens: cold {v['cold_ttft_s']:.2f} s (A) / {v['cold_fresh_ns_ttft_s']:.2f} s (B, fresh ns)"
              f" | cross-node hit {v['hit_ttft_s']:.3f} s (median of {v['hit_repeats']}; fetch+verify+upload "
              f"{v['hit_fetch_s']:.3f} s, {v['hit_cached_tokens']} cached tokens, {v['hit_MB']:.0f} MB) | "
              f"hit/cold = {v['hit_vs_cold']:.3f}x (goal <= 0.3x at 4k) | redis round trips: "
              f"{v['hit_fetch_round_trips']} per hit fetch, {v['cold_fetch_round_trips']} per cold miss, "
              f"{v['publish_round_trips']} to publish")


async def bench_ttft(url: str, args) -> dict:
    import torch

    from edgeinfer.backend.engine.engine_config import EngineConfig
    from edgeinfer.backend.engine.loading import load_engine
    from edgeinfer.backend.model.gguf_import import ensure_default_model
    from edgeinfer.backend.page_store.bridge import PageStoreBridge
    from edgeinfer.cache_store.store import HostPageStore, TieredPageStore
    from edgeinfer.protocol.wire import GenerateRequest, SamplingParams

    lengths = [int(x) for x in args.ttft_tokens.split(",")]
    model_dir = ensure_default_model()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    pages = max(lengths) // 16 + 40
    engines, bridges, redis_stores = [], [], []
    for node in ("A", "B"):
        e = load_engine(model_dir, EngineConfig(num_pages=pages, cache_seed=b"bench"), dtype=dtype)
        e.start()
        client = redis_client(url, socket_timeout_s=5)
        guard = RedisGuard(timeout_s=2)
        rs = RedisPageStore(client, guard=guard, timeout_s=5)
        store = TieredPageStore([("host", HostPageStore(1 << 30)), ("redis", rs)])
        br = PageStoreBridge(e, node_id=node, store=store, page_key=KEY, index=RedisPageIndex(client, guard=guard),
                             redis_client=client, fetch_timeout_s=10)
        await br.start()
        engines.append(e)
        bridges.append(br)
        redis_stores.append(rs)
    (ea, eb), (ba, bb), (ra, _rb) = engines, bridges, redis_stores
    rng = np.random.default_rng(5)

    async def run(engine, bridge, prompt, ns) -> tuple[float, float, int, int]:
        req = GenerateRequest(f"r{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                                ignore_eos=True), ns)
        rs = bridge.store.tier("redis")
        rt = rs.round_trips
        t0 = time.perf_counter()
        await bridge.before_generate(None, req)
        t_fetch = time.perf_counter() - t0
        fetch_rt = rs.round_trips - rt
        ttft, usage = None, None
        async for ch in engine.generate(req):
            if ttft is None and ch.token_ids:
                ttft = time.perf_counter() - t0
            usage = ch.usage or usage
        return ttft, t_fetch, usage.cached_tokens, fetch_rt

    out: dict = {"model": ea.model_name, "dtype": args.dtype, "kv_format": ea.kv_format,
                 "page_bytes": ea.runner.page_bytes, "torch_threads": torch.get_num_threads(), "prompts": {}}
    try:
        # warm-up (first-call allocations) on both engines, in a namespace nothing else uses
        warm = rng.integers(100, 40000, 64).tolist()
        await run(ea, ba, warm, "warm")
        await run(eb, bb, warm, "warm2")
        for n in lengths:
            prompt = rng.integers(100, 40000, n).tolist()
            rt = ra.round_trips
            cold, _, cached, cold_miss_rt = await run(ea, ba, prompt, "bench")
            assert cached == 0
            await ba.flush(60)
            publish_rt = ra.round_trips - rt - cold_miss_rt
            hashes = page_hashes(ea.key_context("bench"), prompt)
            hits, fetches, rts = [], [], []
            for _ in range(args.hit_repeats):
                await eb.call_in_engine(lambda hs=hashes: [eb.blocks.drop_cached(h) for h in hs])
                ttft, t_fetch, cached_hit, hit_rt = await run(eb, bb, prompt, "bench")
                rts.append(hit_rt)
                hits.append(ttft)
                fetches.append(t_fetch)
                assert cached_hit >= (n - 1) // 16 * 16, cached_hit
            fresh, _, _, _ = await run(eb, bb, prompt, "bench-fresh")
            await bb.flush(60)
            hit = statistics.median(hits)
            out["prompts"][str(n)] = {
                "cold_ttft_s": cold, "cold_fresh_ns_ttft_s": fresh, "hit_ttft_s": hit, "hit_ttft_all_s": hits,
                "hit_fetch_s": statistics.median(fetches), "hit_repeats": len(hits), "hit_cached_tokens": cached_hit,
                "hit_MB": cached_hit // 16 * ea.runner.page_bytes / 1e6,
                "hit_vs_cold": hit / min(cold, fresh), "hit_fetch_round_trips": statistics.median(rts),
                "cold_fetch_round_trips": cold_miss_rt, "publish_round_trips": publish_rt,
                "publish_note": "store pipelines of <= 16 MB + one index pipeline each, in the background",
            }
    finally:
        for br in bridges:
            await br.stop()
        for e in engines:
            e.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter timing loops")
    ap.add_argument("--skip-ttft", action="store_true", help="leave out the TTFT part (loads the model)")
    ap.add_argument("--ttft-tokens", default="1024,4096", help="prompt lengths for the TTFT part")
    ap.add_argument("--hit-repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    results: dict = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "page": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE},
    }
    results["codec"] = bench_codec(args.quick)
    with ValkeyServer() as server:
        results["redis_transfer"] = asyncio.run(bench_redis_transfer(server.url, args.quick, results["codec"]))
        results["lookup"] = {
            "single_lua": asyncio.run(bench_lookup(server.url, False, args.quick)),
            "single_pipelined": asyncio.run(bench_lookup(server.url, False, args.quick, server_side=False)),
        }
    with ValkeyCluster(3) as cluster:
        results["lookup"]["cluster3_lua"] = asyncio.run(bench_lookup(cluster.url, True, args.quick))

    if args.skip_ttft:
        results["ttft_cold_vs_cross_node_hit"] = {"status": "skipped (--skip-ttft)"}
    else:
        with ValkeyServer() as server:
            results["ttft_cold_vs_cross_node_hit"] = asyncio.run(bench_ttft(server.url, args))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_report(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
