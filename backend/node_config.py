"""The backend's configuration: its command line (parse_args: every flag, its default and its check) and the
frozen value built from it once (BackendConfig), read by backend.server.build_state and the page-store wiring."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.spec.policy import SPECULATIVE
from edgeinfer.protocol.defaults import (
    CACHE_SEED,
    CACHE_SEED_ENV,
    DEFAULT_KV_KLD_BUDGET,
    KEY_PREFIX,
    PAGE_SIZE,
    SERVE_OPTIONS,
    drop_env_sources,
    env_defaults,
    named,
    on_command_line,
)
from edgeinfer.protocol.secrets import is_loopback, placeholder, weak_secret
from edgeinfer.protocol.wire import ROLES
from edgeinfer.telemetry.observability import LOG_LEVELS

VERSION = os.environ.get("EDGEINFER_VERSION", "0.1.0")
INTERNAL_SECRET_ENV = "EDGEINFER_INTERNAL_SECRET"


@dataclass(frozen=True)
class BackendConfig:
    model: str | None
    model_name: str | None
    host: str
    port: int
    node_id: str | None
    dtype: str
    device: str
    tensor_parallel: int      # ranks of this node (backend/parallel): 1 = one process
    expert_parallel: bool     # split the routed experts by rank instead of each expert's width
    page_size: int
    kv_dtype: str
    kv_kld_budget: float      # nats of mean KLD vs fp32 KV that `--kv-dtype auto` allows (backend/quant/kv_gate.py)
    kv_cache_bytes: int
    num_pages: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    max_queue_wait_s: float   # 0: no bound
    keepalive_s: float   # 0: no keepalive lines
    no_prefix_cache: bool
    scheduler: str
    cache_eviction: str
    prefill_token_weight: float
    decode_token_weight: float
    priority_aging_steps: int
    no_fair_preemption: bool
    no_prefill_isolation: bool
    contended_step_tokens: int   # 0: no cap
    contended_step_ratio: float  # 0: the fixed token cap only
    contended_window_s: float
    no_cuda_graphs: bool
    no_kv_integrity: bool
    kv_verify_fraction: float
    fixed_threads: bool
    redis_url: str | None
    redis_cluster: bool
    store_tier: str   # redis | host | none
    host_store_bytes: int
    store_fetch_timeout: float
    redis_key_prefix: str
    cache_seed: str
    operator_key: str | None
    internal_secret_file: str | None
    insecure_no_internal_auth: bool
    internal_secret: str | None   # None only with --insecure-no-internal-auth
    page_key_file: str | None
    start_drained: bool
    version: str
    heartbeat: float
    log_level: str
    log_format: str           # text | json (telemetry/observability.py)
    advertise_url: str | None  # registered URL (default http://host:port)
    otlp_endpoint: str | None  # OpenTelemetry collector (OTLP/HTTP); else OTEL_EXPORTER_OTLP_ENDPOINT; else no traces
    speculative: str          # ngram | off (backend/engine/spec/)
    spec_tokens: int
    spec_max_batch: int
    no_grammar_fast_forward: bool
    role: str                 # prefill | decode | both (prefill/decode disaggregation, docs/DISAGGREGATION.md)
    handoff_timeout: float    # seconds a decode node spends pulling a prompt's pages from its prefill node
    handoff_peers: list[str]  # prefill nodes' URLs a decode node may pull from (besides the registry's signed ones)
    grammar_mask_budget_ms: float  # a request's grammar mask may take this long per step (0: no budget)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> BackendConfig:
        """The parsed flags, one field per dest: the parser owns the defaults, and a flag without a field (or a
        field without a flag) is a TypeError here, not a silent default."""
        return cls(**vars(drop_env_sources(ns)))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(page_size=self.page_size, kv_cache_bytes=self.kv_cache_bytes, num_pages=self.num_pages,
                            kv_dtype=self.kv_dtype, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                            cache_seed=self.cache_seed.encode(), enable_prefix_cache=not self.no_prefix_cache,
                            scheduler=self.scheduler, cache_eviction=self.cache_eviction,
                            prefill_token_weight=self.prefill_token_weight,
                            decode_token_weight=self.decode_token_weight,
                            priority_aging_steps=self.priority_aging_steps,
                            fair_preemption=not self.no_fair_preemption,
                            prefill_isolation=not self.no_prefill_isolation,
                            contended_step_tokens=self.contended_step_tokens,
                            contended_step_ratio=self.contended_step_ratio,
                            contended_window_s=self.contended_window_s, cuda_graphs=not self.no_cuda_graphs,
                            adaptive_threads=not self.fixed_threads, kv_integrity=not self.no_kv_integrity,
                            kv_verify_fraction=self.kv_verify_fraction, speculative=self.speculative,
                            spec_tokens=self.spec_tokens, spec_max_batch=self.spec_max_batch,
                            grammar_fast_forward=not self.no_grammar_fast_forward,
                            grammar_mask_budget_s=self.grammar_mask_budget_ms / 1e3)


# the command line in groups, each adding its own arguments (--help lists them under these titles)
def _server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server", "the node's HTTP server and lifecycle")
    g.add_argument("--model", default=None, help="HF checkpoint directory (default: SmolLM2-135M-Instruct, the GGUF's INT4 weights)")
    g.add_argument("--model-name", default=None, help="name served to clients (default: directory name)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8100)
    g.add_argument("--advertise-url", default=None,
                   help="the URL other nodes and gateways reach this node at, as registered (default http://HOST:PORT; "
                        "set it when --host is 0.0.0.0, e.g. a pod's stable DNS name in a StatefulSet)")
    g.add_argument("--node-id", default=None)
    g.add_argument("--version", default=VERSION)
    g.add_argument("--heartbeat", type=float, default=2.0)
    g.add_argument("--start-drained", action="store_true",
                   help="register as draining: no routed traffic until `edgeinfer ops undrain` (rollouts run "
                        "their canary first); needs --operator-key")
    g.add_argument("--max-queue-wait-s", type=float, default=300.0,
                   help="refuse (503 + Retry-After) a request whose estimated wait for its first token is longer; "
                        "0: no bound")
    g.add_argument("--keepalive-s", type=float, default=1.0,
                   help="empty line on a stream silent this long while the engine steps (0: none); keep it well "
                        "under the gateway's first_byte_timeout_s")


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine", "the model and the engine (scheduling, KV, speculation, grammars)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--tensor-parallel", type=int, default=1,
                   help="ranks of this node on torch.distributed (gloo on CPU): attention heads, MLP widths and the "
                        "vocab split across them; rank 0 is this process (default 1)")
    g.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel: split the routed experts by rank instead of each expert's width")
    g.add_argument("--device", default="cpu")
    g.add_argument("--page-size", type=int, default=PAGE_SIZE)
    g.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16", "fp8_e4m3", "int8"],
                   help="KV pages' dtype (default auto: at a model's first start int8, fp8_e4m3 and bf16 are each "
                        "measured against fp32 KV, by KL divergence on a calibration text, and the most compact "
                        "within --kv-kld-budget is served; on the default model that is int8: a scale per "
                        "token-head, q and k Hadamard-rotated, 3.9x the tokens of fp32 in the same bytes; "
                        "docs/QUANTIZATION.md). A named dtype is served as named, its measured cost logged")
    g.add_argument("--kv-kld-budget", type=float, default=DEFAULT_KV_KLD_BUDGET,
                   help=f"mean KL divergence from fp32 KV (nats per token) that --kv-dtype auto may cost (default "
                        f"{DEFAULT_KV_KLD_BUDGET}; 0: measure nothing, auto serves fp32)")
    g.add_argument("--kv-cache-bytes", type=int, default=512 << 20,
                   help="KV pool budget (default 512 MiB: 45k tokens of fp8 KV for the default model, 11.6k of fp32); "
                        "memory becomes resident as pages are first used")
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--scheduler", default="fair", choices=["fair", "fifo"],
                   help="fair: per-tenant virtual token counter (weights, priority classes); fifo: arrival order")
    g.add_argument("--cache-eviction", default="fair", choices=["fair", "lru"],
                   help="fair: evict cached pages of the tenant most over its share first; lru: oldest first")
    g.add_argument("--prefill-token-weight", type=float, default=1.0, help="fair scheduler: cost of a prefill token")
    g.add_argument("--decode-token-weight", type=float, default=2.0, help="fair scheduler: cost of a decode token")
    g.add_argument("--priority-aging-steps", type=int, default=256,
                   help="fair scheduler: a waiting request's priority class improves by one per this many steps")
    g.add_argument("--no-fair-preemption", action="store_true",
                   help="fair scheduler: never preempt a tenant over its slot share to admit one under it")
    g.add_argument("--no-prefill-isolation", action="store_true",
                   help="fair scheduler: let over-share tenants' prefill share a step with an under-share first token")
    g.add_argument("--contended-step-tokens", type=int, default=32,
                   help="fair scheduler: while more than one tenant is active, a step computes at most this many "
                        "prefill tokens (the step a newly arrived request waits on stays short) until the step "
                        "cost is measured, and always with --contended-step-ratio 0; 0: no cap, the step takes "
                        "--max-num-batched-tokens")
    g.add_argument("--contended-step-ratio", type=float, default=1.0,
                   help="fair scheduler: once the engine has measured what its steps cost, a contended step's "
                        "prefill tokens are those whose predicted time is at most this times the rest of the "
                        "step (its decodes and fixed cost); 0: the fixed --contended-step-tokens cap")
    g.add_argument("--contended-window-s", type=float, default=1.0,
                   help="fair scheduler: a tenant counts as active for the step cap this long after its last "
                        "request left (a closed-loop client between two requests)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    g.add_argument("--no-kv-integrity", action="store_true",
                   help="turn off the live pool's integrity checks: page identity before each step and at prefix "
                        "hits, store receives and frees, and sealed-page checksums (backend/engine/kv_integrity.py)")
    g.add_argument("--kv-verify-fraction", type=float, default=1.0,
                   help="of the sealed pages a prefix hit reuses, the fraction whose checksum is verified (default 1: "
                        "every page; costs < 2%% of decode at 32 sequences, benchmarks/engine/kv_integrity.py)")
    g.add_argument("--fixed-threads", action="store_true",
                   help="CPU: keep every step on torch's thread count; by default the engine uses the cores other "
                        "processes leave free (a busy neighbour on one of two cores otherwise stalls every op's "
                        "barrier: batch-1 decode fell from ~155 to 2-68 tok/s, docs/KERNELS.md)")
    g.add_argument("--speculative", default="ngram", choices=list(SPECULATIVE),
                   help="speculative decoding: ngram (drafts looked up in the prompt and output so far, verified k "
                        "at a time; adaptive: only while few sequences decode and a sequence's drafts get accepted), "
                        "mtp (the checkpoint's multi-token-prediction layer drafts one token: DeepSeek-V3 / Kimi K2 / "
                        "GLM-4.5 checkpoints that ship it) or off; greedy output is the same either way "
                        "(docs/SPECULATIVE.md)")
    g.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per verify step (1..16)")
    g.add_argument("--spec-max-batch", type=int, default=64,
                   help="no drafts in a step with more decoding sequences than this (a large batch is compute-bound)")
    g.add_argument("--no-grammar-fast-forward", action="store_true",
                   help="structured outputs: sample every token, also those the grammar forces")
    g.add_argument("--grammar-mask-budget-ms", type=float, default=20.0,
                   help="a structured-output request whose grammar takes longer than this to compute one token's "
                        "mask (measured per step, off the shared step's critical path) ends with a 400 naming its "
                        "response_format / tool field instead of stalling its neighbours; 0: no budget")


def _store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("store", "the shared page store (Redis / valkey)")
    g.add_argument("--redis-url", default=os.environ.get("EDGEINFER_REDIS_URL"))
    g.add_argument("--redis-cluster", action="store_true")
    g.add_argument("--store-tier", default="redis", choices=["redis", "host", "none"])
    g.add_argument("--host-store-bytes", type=int, default=256 << 20)
    g.add_argument("--store-fetch-timeout", type=float, default=1.0,
                   help="seconds a request may spend fetching KV pages from the store before computing them")
    g.add_argument("--redis-key-prefix", default=KEY_PREFIX, help="prefix of every Redis key (same as the gateway's)")
    g.add_argument("--cache-seed", default=os.environ.get(CACHE_SEED_ENV, CACHE_SEED))


def _security_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security", "secrets and operator access")
    g.add_argument("--operator-key", default=os.environ.get("EDGEINFER_OPERATOR_KEY"))
    g.add_argument("--internal-secret-file", default=None,
                   help=f"file holding the secret the gateway sends on /internal/* (default: ${INTERNAL_SECRET_ENV})")
    g.add_argument("--insecure-no-internal-auth", action="store_true",
                   help="serve /internal/* to anyone who can connect (only on a trusted, isolated network)")
    g.add_argument("--page-key-file", default=None,
                   help="file holding the key that seals KV pages in the store (default: $EDGEINFER_PAGE_KEY, "
                        "else derived from the cache seed); the same on every node")


def _telemetry_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("telemetry", "logs and traces")
    g.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    g.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one JSON object per line (ts, level, logger, msg, request_id, trace_id)")
    g.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry traces to this OTLP/HTTP collector (else OTEL_EXPORTER_OTLP_ENDPOINT; "
                        "neither: no tracing); needs pip install 'edgeinfer[otlp]'")


def _disagg_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregation", "prefill/decode disaggregation (docs/DISAGGREGATION.md)")
    g.add_argument("--role", default="both", choices=list(ROLES),
                   help="prefill/decode disaggregation (docs/DISAGGREGATION.md): a prefill node computes prompts' KV "
                        "and hands the pages to a decode node, which verifies them and decodes; both: every request "
                        "start to end (the gateway routes by this role)")
    g.add_argument("--handoff-timeout", type=float, default=5.0,
                   help="seconds a decode node may spend pulling a prompt's pages from the prefill node named in "
                        "the request before it computes the rest itself")
    g.add_argument("--handoff-peers", default="",
                   help="comma-separated URLs of the prefill nodes this decode node may pull pages from (it sends them "
                        "the internal secret); with a registry (--redis-url) its signed, live prefill nodes count too. "
                        "A request naming any other kv_source is computed here, never pulled")


def parse_args(argv: list[str] | None) -> BackendConfig:
    p = argparse.ArgumentParser(prog="edgeinfer backend", description="Run one inference backend node.")
    for add in (_server_args, _engine_args, _store_args, _security_args, _telemetry_args, _disagg_args):
        add(p)
    env_defaults(p, known_elsewhere=SERVE_OPTIONS)
    args = p.parse_args(argv)
    args.handoff_peers = [u.strip().rstrip("/") for u in args.handoff_peers.split(",") if u.strip()]

    def bad(dest: str, expected: str) -> None:
        p.error(f"{named(p, args, dest, argv)}: expected {expected}")

    args.internal_secret = None if args.insecure_no_internal_auth else _internal_secret(p, args)
    if args.advertise_url is not None and not args.advertise_url.startswith(("http://", "https://")):
        bad("advertise_url", "an http:// or https:// URL")
    for u in args.handoff_peers:
        if not u.startswith(("http://", "https://")):
            bad("handoff_peers", f"http:// or https:// URLs (got {u!r})")
    if not 1 <= args.port <= 65535:
        bad("port", "a TCP port 1..65535")
    finite = float("inf")
    for dest, low, what in (("tensor_parallel", 1, "ranks"), ("page_size", 1, "tokens"),
                            ("kv_cache_bytes", 1, "bytes"), ("max_num_seqs", 1, "sequences"),
                            ("max_num_batched_tokens", 1, "tokens"), ("priority_aging_steps", 1, "steps"),
                            ("contended_step_tokens", 0, "tokens (0: no cap)"), ("spec_max_batch", 0, "sequences"),
                            ("host_store_bytes", 0, "bytes")):
        if getattr(args, dest) < low:
            bad(dest, f"an integer >= {low} {what}")
    for dest in ("num_pages", "max_model_len"):
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            bad(dest, "an integer >= 1")
    if not 1 <= args.spec_tokens <= 16:
        bad("spec_tokens", "1..16")
    seconds = "a finite number of seconds > 0"
    weight = "a finite weight > 0"
    for dest, expected in (("handoff_timeout", seconds), ("heartbeat", seconds), ("store_fetch_timeout", seconds),
                           ("prefill_token_weight", weight), ("decode_token_weight", weight)):
        if not (0 < getattr(args, dest) < finite):
            bad(dest, expected)
    for dest, expected in (("max_queue_wait_s", "a finite number of seconds >= 0 (0: off)"),
                           ("keepalive_s", "a finite number of seconds >= 0 (0: off)"),
                           ("contended_step_ratio", "a finite number >= 0 (0: the fixed cap)"),
                           ("contended_window_s", "a finite number of seconds >= 0"),
                           ("grammar_mask_budget_ms", "a finite number of milliseconds >= 0 (0: off)")):
        if not (0 <= getattr(args, dest) < finite):
            bad(dest, expected)
    if not (0.0 <= args.kv_verify_fraction <= 1.0):
        bad("kv_verify_fraction", "a fraction 0 <= f <= 1")
    if not (0 <= args.kv_kld_budget < finite):
        bad("kv_kld_budget", "a finite number of nats >= 0 (0: measure nothing)")
    _check_secrets(p, args, argv)
    if args.start_drained and not args.operator_key:
        p.error("--start-drained needs --operator-key (or EDGEINFER_OPERATOR_KEY): without it the node could "
                "never be undrained")
    return BackendConfig.from_namespace(args)


def _internal_secret(p: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    if args.internal_secret_file:
        try:
            secret = Path(args.internal_secret_file).read_text().strip()
        except OSError as e:
            p.error(f"--internal-secret-file: {e}")
        origin = args.internal_secret_file
    else:
        secret, origin = os.environ.get(INTERNAL_SECRET_ENV, "").strip(), f"${INTERNAL_SECRET_ENV}"
        if not secret:
            p.error(f"no internal secret: set {INTERNAL_SECRET_ENV} or --internal-secret-file (the gateway sends "
                    "it on /internal/*), or pass --insecure-no-internal-auth on an isolated network")
    if (why := weak_secret(secret)) is not None:
        p.error(f"internal secret from {origin} refused: {why}")
    return secret


def _check_secrets(p: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None) -> None:
    """The operator key, the page key and the cache seed: no placeholder, no documented default, not too weak (one
    line naming the setting). The built-in cache seed is a development default: refused on a non-loopback --host."""
    if args.operator_key and (why := weak_secret(args.operator_key)) is not None:
        p.error(f"operator key ({_origin(argv, 'operator_key', 'EDGEINFER_OPERATOR_KEY')}) refused: {why}")
    page_key = os.environ.get("EDGEINFER_PAGE_KEY")
    if not args.page_key_file and page_key and (why := weak_secret(page_key)) is not None:
        p.error(f"page key ($EDGEINFER_PAGE_KEY) refused: {why}")
    if args.page_key_file:
        try:
            text = Path(args.page_key_file).read_text().strip()
        except OSError as e:
            p.error(f"--page-key-file: {e}")
        if (why := weak_secret(text)) is not None:
            p.error(f"page key from {args.page_key_file} refused: {why}")
    seed_origin = _origin(argv, "cache_seed", CACHE_SEED_ENV)
    if args.cache_seed == CACHE_SEED:
        if not is_loopback(args.host):
            p.error(f"cache seed: the built-in development seed on --host {args.host} (reachable from other "
                    f"machines): set {CACHE_SEED_ENV} or --cache-seed to a secret (edgeinfer ops gen-secrets)")
    elif (why := placeholder(args.cache_seed)) is not None:
        p.error(f"cache seed ({seed_origin}) refused: {why}")


def _origin(argv: list[str] | None, dest: str, env: str) -> str:
    """Where a flag whose default comes from a variable of its own (not EDGEINFER_ARG_*) was set."""
    flag = "--" + dest.replace("_", "-")
    return flag if on_command_line([flag], argv) else f"${env}"
