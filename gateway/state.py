"""Everything one gateway process holds, built from the config (the app's single typed AppKey)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from edgeinfer.cache_store.index import InMemoryPageIndex
from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.gateway import config as config_mod
from edgeinfer.gateway.admission import Admission, RedisAdmission
from edgeinfer.gateway.config import GatewayConfig, TenantConfig
from edgeinfer.gateway.context import context
from edgeinfer.gateway.errors import APIError
from edgeinfer.gateway.metrics import Metrics
from edgeinfer.gateway.nodes import Node, NodePool
from edgeinfer.gateway.routing import PrefixIndex, Router
from edgeinfer.gateway.schema_guard import SchemaGuard
from edgeinfer.gateway.served_model import ServedModel
from edgeinfer.gateway.structured import SchemaLimits
from edgeinfer.gateway.tenants import TenantTable
from edgeinfer.gateway.upstream import Upstream

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("edgeinfer.gateway")


def _authorization(request: web.Request) -> str | None:
    """The Authorization header; 401 if it is not UTF-8 (aiohttp keeps such bytes as lone surrogates)."""
    value = request.headers.get("authorization")
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError as e:
            raise APIError(401, "malformed Authorization header: not UTF-8 text; expected `Bearer <key>`",
                           code="invalid_api_key") from e
    return value


def _bearer_sha256(request: web.Request) -> str:
    """sha256 (hex) of the key in `Authorization: Bearer <key>`, as keys are configured; "" (matches no key)
    without one or under another scheme (`Basic <key>` is not a key)."""
    scheme, _, key = (_authorization(request) or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return ""
    return hashlib.sha256(key.strip().encode()).hexdigest()


@dataclass(eq=False)
class GatewayState:
    cfg: GatewayConfig
    models: dict[str, ServedModel]
    tenants: TenantTable
    metrics: Metrics
    pool: NodePool
    router: Router
    upstream: Upstream
    admission: Admission | RedisAdmission    # rate limits + stream caps (gateway/admission/)
    index: PrefixIndex
    fill_index: bool
    schemas: SchemaGuard
    schema_limits: SchemaLimits
    redis: Redis | None = None
    session: aiohttp.ClientSession | None = None
    handlers: set[asyncio.Task] = field(default_factory=set)    # the requests being served, to cut at shutdown
    draining: bool = False
    cut: bool = False               # the shutdown grace is over: handlers cancelled now end with an error
    started: int = field(default_factory=lambda: int(time.time()))
    tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def inflight(self) -> int:
        return len(self.handlers)

    def authenticate(self, request: web.Request) -> TenantConfig:
        tenant = self.tenants.authenticate(_authorization(request))
        context(request).tenant = tenant.id
        return tenant

    def check_admin(self, request: web.Request) -> None:
        want = self.cfg.server.admin_key_sha256
        if not want:
            raise APIError(404, "admin endpoints are disabled (set server.admin_key_sha256)", code="not_found")
        if not hmac.compare_digest(_bearer_sha256(request), want.lower()):
            raise APIError(401, "invalid admin key: expected `Authorization: Bearer <admin key>`",
                           code="invalid_api_key")

    def metrics_trusted(self, request: web.Request) -> bool:
        """Whether the caller may see per-tenant metrics: Bearer <metrics key or admin key>. No credential:
        False (the open series only); a credential that matches neither: 401."""
        if _authorization(request) is None:
            return False
        digest = _bearer_sha256(request)
        wanted = [w.lower() for w in (self.cfg.server.metrics_key_sha256, self.cfg.server.admin_key_sha256) if w]
        if any(hmac.compare_digest(digest, w) for w in wanted):
            return True
        raise APIError(401, "invalid metrics key: per-tenant metrics need `Bearer <key>` with "
                            "server.metrics_key_sha256's or server.admin_key_sha256's key; without a key /metrics "
                            "shows the open series",
                       code="invalid_api_key")

    def reload_tenants(self) -> int:
        """Re-read [[tenants]] from the config file; on error keep the current table and raise ConfigError."""
        if not self.cfg.source:
            raise config_mod.ConfigError("the gateway was started without a config file; nothing to reload")
        fresh = config_mod.load(self.cfg.source)
        self.tenants = TenantTable(fresh.tenants)
        log.info("reloaded %d tenants from %s", len(self.tenants), self.cfg.source)
        return len(self.tenants)

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def get_session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "client session is created in the app's cleanup_ctx"
        return self.session


def build_state(cfg: GatewayConfig, models: dict[str, ServedModel] | None = None, registry=None,
                index=None, redis_client=None) -> GatewayState:
    if models is None:
        models = {m.name: ServedModel.load(m.name, m.tokenizer) for m in cfg.models}
    s = cfg.server
    metrics = Metrics()
    holder: dict = {}

    def session() -> aiohttp.ClientSession:
        return holder["state"].get_session()

    nodes = [Node(n.id, n.url, n.model) for n in cfg.nodes]
    secret = cfg.internal_secret
    pool = NodePool(session, nodes, registry=registry, interval_s=s.health_interval_s,
                    stale_intervals=s.health_stale_intervals,
                    record_key=NodeRecordKey(secret) if secret else None,
                    refused=metrics.node_records_refused)
    if index is None:
        index = InMemoryPageIndex()
    router = Router(index, cfg.seed, s.route_load_cost_tokens, s.route_affinity_tokens, s.route_kv_cost_tokens)
    upstream = Upstream(s.connect_timeout_s, s.first_byte_timeout_s, s.chunk_timeout_s, cfg.internal_auth)
    admission = (RedisAdmission(redis_client, s.key_prefix, s.stream_lease_ttl_s) if redis_client is not None
                 else Admission())
    st = GatewayState(cfg, models, TenantTable(cfg.tenants), metrics, pool, router, upstream, admission, index,
                      fill_index=cfg.fill_index_at_gateway, schemas=SchemaGuard(s.schema_workers, s.schema_check_timeout_s),
                      schema_limits=SchemaLimits.of(s), redis=redis_client)
    holder["state"] = st
    return st


STATE = web.AppKey("edgeinfer_gateway_state", GatewayState)
