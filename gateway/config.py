"""Gateway configuration from TOML, validated with msgspec (a bad or unknown setting is an error).

Only `[[tenants]]` is hot-reloadable (SIGHUP or POST /admin/reload); the rest needs a restart.
"""

from __future__ import annotations

import hashlib
import math
import os
import tomllib
from pathlib import Path

import msgspec

from edgeinfer.protocol.defaults import CACHE_SEED, CACHE_SEED_ENV, KEY_PREFIX
from edgeinfer.protocol.secrets import PLACEHOLDER_KEYS, is_loopback, placeholder, weak_secret
from edgeinfer.protocol.wire import TenantSpec

DEFAULT_CONFIG = Path(__file__).with_name("default_config.toml")
DEMO_API_KEY = "sk-edgeinfer-demo"


class ConfigError(ValueError):
    pass


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 8
    default_max_tokens: int = 512
    body_read_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 120.0     # silence before the first chunk (backend keepalives restart it)
    chunk_timeout_s: float = 60.0           # max silence between two chunks of a stream (keepalives count)
    keepalive_timeout_s: float = 75.0
    shutdown_grace_s: float = 30.0
    health_interval_s: float = 1.0
    health_stale_intervals: int = 3         # unanswered this many health intervals: unroutable, waits moved
    max_attempts: int = 3                   # nodes tried before the first byte
    admin_key_sha256: str = ""              # empty: admin endpoints disabled
    metrics_key_sha256: str = ""            # a scraper's key: /metrics with per-tenant series (the admin key too)
    page_seed_env: str = CACHE_SEED_ENV  # same variable backend.server reads for --cache-seed
    page_seed: str = CACHE_SEED   # the env var wins; must equal the backends' --cache-seed
    internal_secret_env: str = "EDGEINFER_INTERNAL_SECRET"  # same variable backend.server reads
    internal_secret: str = ""               # the env var wins; sent to backends on /internal/* (empty: nothing sent)
    tenants_file: str = ""                  # more [[tenants]] from this TOML (relative to the config; deploys keep
                                            # tenant key hashes in a Secret: edgeinfer ops gen-secrets writes one)
    allow_public_demo_key: bool = False     # serve the public demo key (sk-edgeinfer-demo) on a non-loopback host
    redis_url: str = ""                     # empty: single-node mode (in-process limiter and index)
    redis_cluster: bool = False             # redis_url names a node of a Redis/valkey Cluster (every tier on it)
    key_prefix: str = KEY_PREFIX
    index_fill: str = "auto"                # "gateway" | "backends" | "auto" (gateway iff no redis)
    route_load_cost_tokens: int = 32        # one in-flight request costs as much as this many cached tokens
    route_affinity_tokens: int = 256        # bonus of the x-session-affinity node, in cached tokens
    route_kv_cost_tokens: int = 256         # a node's full KV pool costs as much as this many cached tokens
    # prefill/decode disaggregation (docs/DISAGGREGATION.md), on when the pool has --role prefill nodes
    disagg_min_prefill_tokens: int = 256    # prompt tokens the decode node would compute below which it prefills itself
    disagg_prefill_timeout_s: float = 60.0  # the prefill hop, start to "prefilled"; over it the decode node computes
    autoscale_kv_target: float = 0.8        # pool_load_ratio: KV usage a pool should run at (0..1]
    autoscale_ttft_target_s: float = 2.0    # pool_load_ratio: the queue wait for a first token a pool should keep
    stream_lease_ttl_s: float = 30.0        # with redis: a dead gateway's share of max_concurrent_streams frees after this
    tokenizer_workers: int = 2              # processes tokenizing long prompts off the event loop (0: a thread)
    schema_workers: int = 1                 # processes checking JSON schemas off the event loop (0: a thread)
    schema_check_timeout_s: float = 5.0     # one request's schema checks; over it: 400, the workers replaced
    max_schema_bytes: int = 128 * 1024      # one schema (response_format, guided_json, a tool's parameters)
    max_schema_depth: int = 64              # JSON nesting of a schema or of any free-form field
    max_schema_properties: int = 1000       # `properties` keys in one schema, together
    max_schema_alternatives: int = 1000     # anyOf/oneOf/allOf branches + enum values (+ guided_choice values)
    max_tools: int = 128                    # functions in one request's tools
    access_log: bool = True


class ServedModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    tokenizer: str                          # checkpoint directory with tokenizer.json


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    url: str
    model: str


class TenantConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    api_key_sha256: list[str]
    models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    cache_group: str = ""                   # share the prefix cache with tenants of the same group
    requests_per_min: int = 0               # 0: unlimited
    tokens_per_min: int = 0
    max_concurrent_streams: int = 0
    max_prompt_tokens: int = 0
    max_prompt_chars: int = 1_000_000       # checked before tokenizing; 0: only max_body_bytes bounds it
    weight: float = 1.0                     # backend fair scheduling: share of served tokens and cached pages
    priority: int = 0                       # 0 is served first; 1..9 wait behind it (aged, never starved)
    retain: bool = True                     # false: KV pages never cached, published or indexed (privacy)
    max_running_pages: int = 0              # hard cap on KV pages its running requests hold per backend (0: none)

    @property
    def namespace(self) -> str:
        return self.cache_group or f"tenant:{self.id}"

    def spec(self) -> TenantSpec:
        """What the backends learn about this tenant (GenerateRequest.tenant)."""
        return TenantSpec(self.id, self.weight, self.priority, self.retain, self.max_running_pages)

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


class GatewayConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    server: ServerConfig = ServerConfig()
    models: list[ServedModelConfig] = []
    nodes: list[NodeConfig] = []
    tenants: list[TenantConfig] = []
    source: str = ""

    @property
    def seed(self) -> bytes:
        """Deployment secret mixed into every page hash (UTF-8 bytes, as backend.server's --cache-seed)."""
        return (os.environ.get(self.server.page_seed_env) or self.server.page_seed).encode()

    @property
    def internal_secret(self) -> str:
        """The secret shared with the backends ("" without one): sent on /internal/*, checks node records."""
        secret = (os.environ.get(self.server.internal_secret_env) or self.server.internal_secret).strip()
        if any(c.isspace() or not c.isprintable() for c in secret):
            raise ConfigError(f"the internal secret (${self.server.internal_secret_env} or server.internal_secret) "
                              "must be printable characters without whitespace")
        return secret

    @property
    def internal_auth(self) -> dict[str, str]:
        """Headers proving to a backend that this is the gateway (empty without a secret)."""
        secret = self.internal_secret
        return {"authorization": f"Bearer {secret}"} if secret else {}

    @property
    def fill_index_at_gateway(self) -> bool:
        return self.server.index_fill == "gateway" or (self.server.index_fill == "auto" and not self.server.redis_url)


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _check(cfg: GatewayConfig) -> GatewayConfig:
    s = cfg.server
    for name in ("max_body_bytes", "max_n", "default_max_tokens", "max_attempts", "max_schema_bytes",
                 "max_schema_depth", "max_schema_properties", "max_schema_alternatives", "max_tools"):
        if getattr(s, name) < 1:
            raise ConfigError(f"server.{name}={getattr(s, name)} must be >= 1")
    if s.schema_workers < 0:
        raise ConfigError(f"server.schema_workers={s.schema_workers} must be >= 0 (0: check schemas in a thread)")
    if s.tokenizer_workers < 0:
        raise ConfigError(f"server.tokenizer_workers={s.tokenizer_workers} must be >= 0 (0: tokenize in a thread)")
    for name in ("body_read_timeout_s", "connect_timeout_s", "first_byte_timeout_s", "chunk_timeout_s",
                 "keepalive_timeout_s", "shutdown_grace_s", "health_interval_s", "stream_lease_ttl_s",
                 "schema_check_timeout_s", "disagg_prefill_timeout_s", "autoscale_ttft_target_s"):
        v = getattr(s, name)
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"server.{name}={v!r} is invalid: expected a finite number of seconds > 0")
    for name in ("disagg_min_prefill_tokens", "route_kv_cost_tokens"):
        if getattr(s, name) < 0:
            raise ConfigError(f"server.{name}={getattr(s, name)} must be >= 0")
    if not (math.isfinite(s.autoscale_kv_target) and 0 < s.autoscale_kv_target <= 1):
        raise ConfigError(f"server.autoscale_kv_target={s.autoscale_kv_target!r} is invalid: expected a fraction "
                          "in (0, 1]")
    if s.health_stale_intervals < 2:
        raise ConfigError(f"server.health_stale_intervals={s.health_stale_intervals} must be >= 2: a node is "
                          "unhealthy once its probes have gone unanswered for that many health_interval_s, "
                          "and below 2 a node answering on time would flap")
    if s.index_fill not in ("gateway", "backends", "auto"):
        raise ConfigError(f"server.index_fill={s.index_fill!r}: expected gateway, backends or auto")
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names):
        raise ConfigError(f"duplicate model names in [[models]]: {names}")
    for n in cfg.nodes:
        if n.model not in names:
            raise ConfigError(f"node {n.id!r} serves model {n.model!r}, which has no [[models]] entry; "
                              f"configured: {', '.join(names) or 'none'}")
    seen: dict[str, str] = {}
    ids = set()
    for t in cfg.tenants:
        if t.id in ids:
            raise ConfigError(f"duplicate tenant id {t.id!r}")
        ids.add(t.id)
        if t.cache_group.startswith("tenant:"):
            raise ConfigError(f"tenant {t.id!r}: cache_group={t.cache_group!r} is invalid: the 'tenant:' prefix is "
                              "reserved for private namespaces (it would share another tenant's cache)")
        for h in t.api_key_sha256:
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h.lower()):
                raise ConfigError(f"tenant {t.id!r}: api_key_sha256 entries must be 64 hex chars "
                                  f"(sha256 of the key; `edgeinfer gateway hash-key KEY`)")
            if h.lower() in seen:
                raise ConfigError(f"tenants {seen[h.lower()]!r} and {t.id!r} share an API key")
            seen[h.lower()] = t.id
        try:
            t.spec().validate()
        except ValueError as e:
            raise ConfigError(f"tenant {t.id!r}: {str(e).removeprefix('tenant.')}") from e
        for name in ("requests_per_min", "tokens_per_min", "max_concurrent_streams", "max_prompt_tokens",
                     "max_prompt_chars"):
            if getattr(t, name) < 0:
                raise ConfigError(f"tenant {t.id!r}: {name}={getattr(t, name)} must be >= 0 (0: unlimited)")
    return cfg


def check_secrets(cfg: GatewayConfig) -> None:
    """No placeholder or documented secret where the gateway listens beyond loopback, and none anywhere for the
    internal secret (ConfigError naming the setting): issue 54."""
    s = cfg.server
    secret = cfg.internal_secret
    if secret and (why := weak_secret(secret)) is not None:
        raise ConfigError(f"the internal secret (${s.internal_secret_env} or server.internal_secret) refused: {why}")
    seed = (os.environ.get(s.page_seed_env) or s.page_seed)
    if seed != CACHE_SEED and (why := placeholder(seed)) is not None:
        raise ConfigError(f"the page seed (${s.page_seed_env} or server.page_seed) refused: {why}")
    if not is_loopback(s.host) and seed == CACHE_SEED:
        raise ConfigError(f"the page seed is the built-in development seed and the gateway listens on {s.host}: set "
                          f"${s.page_seed_env} (the same on every backend; edgeinfer ops gen-secrets)")
    check_tenant_keys(cfg)


def check_tenant_keys(cfg: GatewayConfig) -> None:
    """No tenant key that is a documented placeholder; the public demo key only on loopback unless allowed."""
    s = cfg.server
    placeholders = {hash_key(k): k for k in PLACEHOLDER_KEYS}
    demo = hash_key(DEMO_API_KEY)
    for t in cfg.tenants:
        for h in t.api_key_sha256:
            if h.lower() in placeholders:
                raise ConfigError(f"tenant {t.id!r}: api_key_sha256 {h[:12]}... is the hash of the documented "
                                  f"placeholder key {placeholders[h.lower()]!r}; give the tenant a key of its own "
                                  "(edgeinfer ops gen-secrets)")
            if h.lower() == demo and not is_loopback(s.host) and not s.allow_public_demo_key:
                raise ConfigError(f"tenant {t.id!r} has the public demo key {DEMO_API_KEY!r} and the gateway "
                                  f"listens on {s.host} (beyond this machine): configure your own tenants "
                                  "(--config), or say so explicitly (serve --allow-public-demo-key; "
                                  "server.allow_public_demo_key = true)")


def parse(data: dict, source: str = "") -> GatewayConfig:
    try:
        cfg = msgspec.convert({**data, "source": source}, GatewayConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source or 'config'}: {e}") from e
    return _check(cfg)


def load(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e
    if "source" in data:   # the file's own path, filled in by parse(): a `source` key in a file is not a setting
        raise ConfigError(f"{path}: Object contains unknown field `source`")
    base = path.parent
    tenants_file = data.get("server", {}).get("tenants_file", "")
    if tenants_file:
        tpath = Path(tenants_file) if Path(tenants_file).is_absolute() else base / tenants_file
        try:
            more = tomllib.loads(tpath.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: server.tenants_file: {e}") from e
        if set(more) - {"tenants"}:
            raise ConfigError(f"{tpath}: expected only [[tenants]] tables, got {sorted(set(more) - {'tenants'})}")
        data = {**data, "tenants": [*data.get("tenants", []), *more.get("tenants", [])]}
    cfg = parse(data, str(path))
    models = [m if m.tokenizer == "default" or Path(m.tokenizer).is_absolute()
              else msgspec.structs.replace(m, tokenizer=str(base / m.tokenizer)) for m in cfg.models]
    return msgspec.structs.replace(cfg, models=models)
