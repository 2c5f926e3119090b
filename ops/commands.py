"""`edgeinfer ops ...`: the operator CLI over the node registry and the backends' admin endpoints.

  edgeinfer ops status [--model M] [--json]
  edgeinfer ops drain NODE [--deadline S]
  edgeinfer ops undrain NODE
  edgeinfer ops rollout --model M --to VERSION --command 'TEMPLATE' [--dry-run] [--nodes a,b]
  edgeinfer ops gen-secrets (--compose [DIR] | --k8s [DIR])   fresh secrets + a tenant key (ops/gen_secrets.py)

NODE is a node id from the registry or a backend URL (http://host:port). The registry is
--redis-url (EDGEINFER_REDIS_URL) with --redis-key-prefix (default ei). Admin calls use
--operator-key or, better (not visible in `ps`), EDGEINFER_OPERATOR_KEY. With EDGEINFER_INTERNAL_SECRET set,
registry records not signed with it (cache_store.node_auth) are left out (named on stderr): the operator
key is then sent only to genuine nodes; without it every record is shown and used as before. Exit codes: 0 ok,
1 failed (a rollout that failed and was rolled back), 2 usage or setup error, 3 rollback failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import msgspec

from edgeinfer.cache_store.node_auth import NodeRecordKey
from edgeinfer.cache_store.wiring import wire_redis
from edgeinfer.ops.gen_secrets import GenSecretsError, generate
from edgeinfer.ops.local_state import running_redis_url
from edgeinfer.ops.node_client import CANARY_PROMPT_IDS, NodeClient, NodeError
from edgeinfer.ops.rollout import Rollout, RolloutOptions, Target
from edgeinfer.protocol.defaults import KEY_PREFIX


class OpsError(Exception):
    """A setup problem the operator can fix (no registry, unknown node); exit code 2."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("EDGEINFER_REDIS_URL") or running_redis_url(),
                   help="the node registry (default: $EDGEINFER_REDIS_URL, else the embedded valkey of an "
                        "`edgeinfer serve` running on this machine)")
    p.add_argument("--redis-key-prefix", default=os.environ.get("EDGEINFER_REDIS_KEY_PREFIX", KEY_PREFIX))
    p.add_argument("--redis-cluster", action="store_true",
                   default=os.environ.get("EDGEINFER_REDIS_CLUSTER", "").lower() in ("1", "true"),
                   help="the registry is a Redis/valkey Cluster (default: $EDGEINFER_REDIS_CLUSTER=1)")
    p.add_argument("--operator-key", default=os.environ.get("EDGEINFER_OPERATOR_KEY"),
                   help="admin key of the backends (default: $EDGEINFER_OPERATOR_KEY)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgeinfer ops", description="Operate backend nodes.")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("status", help="table of registered nodes")
    _common(s)
    s.add_argument("--model")
    s.add_argument("--json", action="store_true")
    d = sub.add_parser("drain", help="stop new requests to a node and wait until it is empty")
    _common(d)
    d.add_argument("node")
    d.add_argument("--deadline", type=float, default=60.0, help="seconds to wait for in-flight requests")
    u = sub.add_parser("undrain", help="let a drained node take requests again")
    _common(u)
    u.add_argument("node")
    r = sub.add_parser("rollout", help="upgrade a model's nodes one at a time, rolling back on a failed gate")
    _common(r)
    r.add_argument("--model", required=True)
    r.add_argument("--to", required=True, dest="to_version", metavar="VERSION")
    r.add_argument("--command", required=True,
                   help="shell command that restarts or replaces one node; placeholders {node_id} {url} "
                        "{host} {port} {model} {version} {old_version}")
    r.add_argument("--nodes", default="", help="comma-separated node ids (default: every node of the model)")
    r.add_argument("--dry-run", action="store_true")
    r.add_argument("--drain-deadline", type=float, default=60.0)
    r.add_argument("--command-timeout", type=float, default=300.0)
    r.add_argument("--health-timeout", type=float, default=120.0)
    r.add_argument("--canary-timeout", type=float, default=60.0)
    r.add_argument("--canary-prompt-ids", default=",".join(map(str, CANARY_PROMPT_IDS)))
    r.add_argument("--settle", type=float, default=2.0,
                   help="seconds between re-enabling one node and draining the next (routers catch up)")
    g = sub.add_parser("gen-secrets", help="fresh secrets and a tenant key for compose.yaml or deploy/k8s")
    where = g.add_mutually_exclusive_group(required=True)
    where.add_argument("--compose", nargs="?", const=".", metavar="DIR",
                       help="write DIR/.env and DIR/deploy/compose/tenants.toml (DIR: the repository, default .)")
    where.add_argument("--k8s", nargs="?", const="deploy/k8s", metavar="DIR",
                       help="write DIR/secrets.env and DIR/tenants.toml (default deploy/k8s)")
    return p


def gen_secrets(args: argparse.Namespace) -> int:
    kind, root = ("compose", args.compose) if args.compose is not None else ("k8s", args.k8s)
    try:
        paths, api_key = generate(kind, Path(root))
    except GenSecretsError as e:
        raise OpsError(str(e)) from e
    for p in paths:
        print(f"wrote {p} ({p.stat().st_mode & 0o777:o})", file=sys.stderr)
    print(f"tenant API key (shown once; its sha256 is in {paths[-1]}): {api_key}", file=sys.stderr)
    print(api_key)
    return 0


def _shown(url: str) -> str:
    """The URL without its password (redis://:secret@host -> redis://***@host)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if at and creds else url


def list_nodes(args: argparse.Namespace, model: str | None = None) -> list:
    """Registry records (cache_store.registry.NodeRecord), sorted by node id; OpsError if unreachable."""
    if not args.redis_url:
        raise OpsError("no registry: pass --redis-url or set EDGEINFER_REDIS_URL (or start `edgeinfer serve` "
                       "on this machine: its embedded valkey is found by itself)")

    async def go() -> list:
        redis = wire_redis(args.redis_url, args.redis_key_prefix, cluster=args.redis_cluster, socket_timeout_s=2.0,
                           guard_timeout_s=2.0)
        client = redis.client
        try:
            try:
                await client.ping()
            except (OSError, ConnectionError, TimeoutError) as e:
                raise OpsError(f"registry {_shown(args.redis_url)} unreachable: {e}") from e
            except Exception as e:  # redis.exceptions.ConnectionError is not an OSError
                raise OpsError(f"registry {_shown(args.redis_url)} unreachable: {type(e).__name__}: {e}") from e
            return await redis.registry().list_nodes(model)
        finally:
            await client.aclose()

    return sorted(_believed(asyncio.run(go())), key=lambda r: r.node_id)


def _believed(records: list) -> list:
    secret = os.environ.get("EDGEINFER_INTERNAL_SECRET", "").strip()
    if not secret:
        return records

    key, kept = NodeRecordKey(secret), []
    for r in records:
        if (why := key.refusal(r)) is None:
            kept.append(r)
        else:
            print(f"warning: registry record of node {r.node_id!r} ({r.url}) left out: {why}", file=sys.stderr)
    return kept


def resolve(args: argparse.Namespace, node: str) -> tuple[str, str]:
    """NODE (id or URL) -> (node id, url)."""
    if node.startswith(("http://", "https://")):
        try:
            return NodeClient(node).info().get("node_id", node), node.rstrip("/")
        except (NodeError, ValueError):
            return node, node.rstrip("/")
    records = list_nodes(args)
    for r in records:
        if r.node_id == node:
            return r.node_id, r.url
    known = ", ".join(r.node_id for r in records) or "none"
    raise OpsError(f"unknown node {node!r}; registered: {known}")


def status(args: argparse.Namespace) -> int:
    records = list_nodes(args, args.model)
    now = time.time()
    if args.json:
        print(json.dumps([{**msgspec.to_builtins(r), "load": r.running + r.waiting,
                           "heartbeat_age_s": round(now - r.updated_at, 3)} for r in records], indent=2))
        return 0
    head = ("NODE", "ROLE", "MODEL", "VERSION", "STATE", "LOAD", "KV USE", "CACHE HIT", "HEARTBEAT", "URL")
    rows = [head] + [(r.node_id, r.role, r.model, r.version, r.state, f"{r.running}+{r.waiting}", f"{r.kv_usage:.0%}",
                      f"{r.cache_hit_rate:.0%}", f"{now - r.updated_at:.1f}s ago", r.url) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    if not records:
        print("(no nodes registered" + (f" for model {args.model!r})" if args.model else ")"))
    return 0


def drain(args: argparse.Namespace) -> int:
    node_id, url = resolve(args, args.node)
    node = NodeClient(url, args.operator_key)
    node.drain()
    print(f"{node_id}: draining (no new requests); waiting up to {args.deadline:g}s for in-flight requests",
          flush=True)
    h = node.wait_idle(args.deadline)
    if not h.ok:
        print(f"{node_id}: stopped answering while draining: {h.error}", file=sys.stderr)
        return 1
    if not h.idle:
        print(f"{node_id}: deadline passed with {h.in_flight} in flight ({h.running} running, "
              f"{h.waiting} waiting); still draining", file=sys.stderr)
        return 1
    print(f"{node_id}: drained, nothing in flight; hot pages published to the store")
    return 0


def undrain(args: argparse.Namespace) -> int:
    node_id, url = resolve(args, args.node)
    NodeClient(url, args.operator_key).undrain()
    print(f"{node_id}: active, taking new requests")
    return 0


def rollout(args: argparse.Namespace) -> int:
    try:
        prompt_ids = tuple(int(x) for x in args.canary_prompt_ids.split(",") if x.strip())
    except ValueError as e:
        raise OpsError(f"--canary-prompt-ids {args.canary_prompt_ids!r}: expected comma-separated ints") from e
    if not prompt_ids:
        raise OpsError("--canary-prompt-ids is empty")
    records = list_nodes(args, args.model)
    if not records:
        raise OpsError(f"no registered node serves model {args.model!r}")
    if args.nodes:
        wanted = [n.strip() for n in args.nodes.split(",") if n.strip()]
        missing = sorted(set(wanted) - {r.node_id for r in records})
        if missing:
            raise OpsError(f"--nodes {', '.join(missing)}: not registered for model {args.model!r}")
        records = [r for r in records if r.node_id in wanted]
    targets = []
    for r in records:
        if r.version == args.to_version:
            print(f"{r.node_id}: already at {args.to_version}; skipped", flush=True)
            continue
        targets.append(Target(r.node_id, r.url, r.model, r.version))
    opts = RolloutOptions(command=args.command, to_version=args.to_version, operator_key=args.operator_key,
                          drain_deadline_s=args.drain_deadline, command_timeout_s=args.command_timeout,
                          health_timeout_s=args.health_timeout, canary_timeout_s=args.canary_timeout,
                          canary_prompt_ids=prompt_ids, settle_s=args.settle, dry_run=args.dry_run)
    if not args.dry_run and not args.operator_key:
        raise OpsError("rollout needs the operator key: --operator-key or EDGEINFER_OPERATOR_KEY")
    try:
        job = Rollout(targets, opts)
    except ValueError as e:
        raise OpsError(str(e)) from e
    return job.run()


_ACTIONS = {"status": status, "drain": drain, "undrain": undrain, "rollout": rollout, "gen-secrets": gen_secrets}


def run(cmd: str, argv: list[str]) -> int:
    """Entry point from ops.cli: `edgeinfer ops <action> ...`."""
    args = parser().parse_args(argv)
    try:
        return _ACTIONS[args.action](args)
    except OpsError as e:
        print(f"edgeinfer ops: error: {e}", file=sys.stderr)
        return 2
    except NodeError as e:
        print(f"edgeinfer ops: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    return run("ops", list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
