"""Rolling rollout of one model's nodes, one node at a time, with health gates and rollback.

Per node: drain -> wait until nothing is in flight (or the drain deadline) -> run the operator's
command template (restart or replace the node at the new version) -> wait for /health and the new
version in /internal/info -> canary generate request -> undrain. The first failed gate stops the
rollout; every node touched so far (the failed one included) is put back with the same template and
its old version, through the same gates.

Template placeholders (values are shell-quoted): {node_id} {url} {host} {port} {model} {version}
{old_version}. A template that starts the backend with `--start-drained` keeps the new process out of
routing until its canary passed and the rollout undrains it; without it the node is routable as soon as
it registers (the rollout says so).
"""

from __future__ import annotations

import shlex
import string
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from edgeinfer.ops.node_client import CANARY_PROMPT_IDS, NodeClient, NodeError, host_of, port_of

PLACEHOLDERS = ("node_id", "url", "host", "port", "model", "version", "old_version")


class GateFailed(Exception):
    """A step of one node's upgrade failed; the message says which and why."""


@dataclass(frozen=True)
class Target:
    node_id: str
    url: str
    model: str
    version: str          # what it serves now (the version a rollback returns it to)


@dataclass(frozen=True)
class RolloutOptions:
    command: str
    to_version: str
    operator_key: str | None
    drain_deadline_s: float = 60.0
    command_timeout_s: float = 300.0
    health_timeout_s: float = 120.0
    canary_timeout_s: float = 60.0
    canary_prompt_ids: tuple[int, ...] = CANARY_PROMPT_IDS
    settle_s: float = 2.0           # pause after re-enabling a node, so routers see it before the next drain
    dry_run: bool = False


def check_template(template: str) -> None:
    """Raise ValueError for an unknown placeholder, before any node is touched."""
    for _, name, spec, conv in string.Formatter().parse(template):
        if name is None:
            continue
        if name not in PLACEHOLDERS:
            raise ValueError(f"--command has unknown placeholder {{{name}}}; known: "
                             + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        if spec or conv:
            raise ValueError(f"--command placeholder {{{name}}} takes no format spec or conversion")


def render(template: str, t: Target, version: str) -> str:
    values = {"node_id": t.node_id, "url": t.url, "host": host_of(t.url), "port": str(port_of(t.url)),
              "model": t.model, "version": version, "old_version": t.version}
    return template.format_map({k: shlex.quote(v) for k, v in values.items()})


@dataclass
class Progress:
    out: TextIO = field(default_factory=lambda: sys.stdout)
    t0: float = field(default_factory=time.monotonic)

    def __call__(self, node: str, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {node}: {msg}", file=self.out, flush=True)


class Rollout:
    def __init__(self, targets: list[Target], opts: RolloutOptions, progress: Progress | None = None) -> None:
        check_template(opts.command)
        self.targets = targets
        self.opts = opts
        self.say = progress or Progress()

    def plan(self) -> list[str]:
        return [f"{t.node_id} ({t.url}): {t.version} -> {self.opts.to_version}: "
                f"drain, `{render(self.opts.command, t, self.opts.to_version)}`, health + canary, undrain"
                for t in self.targets]

    def run(self) -> int:
        """0: every node upgraded; 1: a gate failed and the touched nodes were rolled back;
        3: the rollback failed too (the nodes named in the output need a hand)."""
        o = self.opts
        if not self.targets:
            self.say("-", f"nothing to do: no node needs version {o.to_version}")
            return 0
        for line in self.plan():
            self.say("plan", line)
        if o.dry_run:
            self.say("plan", "dry run: nothing changed")
            return 0
        touched: list[Target] = []
        for i, t in enumerate(self.targets):
            touched.append(t)
            self.say(t.node_id, f"[{i + 1}/{len(self.targets)}] upgrading {t.version} -> {o.to_version}")
            try:
                self.replace(t, o.to_version)
            except GateFailed as e:
                self.say(t.node_id, f"FAILED: {e}")
                return self.rollback(touched)
            if i + 1 < len(self.targets) and o.settle_s > 0:
                time.sleep(o.settle_s)
        self.say("-", f"rollout done: {len(self.targets)} node(s) serve {o.to_version}")
        return 0

    def rollback(self, touched: list[Target]) -> int:
        self.say("-", f"rolling back {len(touched)} node(s): " + ", ".join(f"{t.node_id} -> {t.version}"
                                                                         for t in touched))
        stuck = []
        for i, t in enumerate(reversed(touched)):
            if i and self.opts.settle_s > 0:
                time.sleep(self.opts.settle_s)
            try:
                self.replace(t, t.version)
            except GateFailed as e:
                self.say(t.node_id, f"ROLLBACK FAILED: {e}")
                stuck.append(t.node_id)
        if stuck:
            self.say("-", f"rollback incomplete: {', '.join(stuck)} need attention")
            return 3
        self.say("-", f"rolled back: every touched node serves its old version again; {self.opts.to_version} "
                      "was not deployed")
        return 1

    def replace(self, t: Target, version: str) -> None:
        """Drain, restart at `version` via the template, gate on health + canary, re-enable."""
        o = self.opts
        node = NodeClient(t.url, o.operator_key)
        self.drain(node, t)
        cmd = render(o.command, t, version)
        self.say(t.node_id, f"running: {cmd}")
        try:
            done = subprocess.run(cmd, shell=True, timeout=o.command_timeout_s, capture_output=True, text=True)
        except subprocess.TimeoutExpired as e:
            raise GateFailed(f"command did not finish in {o.command_timeout_s:g}s") from e
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-500:]
            raise GateFailed(f"command exited with {done.returncode}" + (f": {tail}" if tail else ""))
        why = node.wait_healthy(o.health_timeout_s, version=version, node_id=t.node_id)
        if why:
            raise GateFailed(f"health gate: {why}")
        state = node.health().state
        if state == "active":
            self.say(t.node_id, f"healthy at {version}, and already active: it took routed traffic before its "
                                "canary (start it with --start-drained in --command to canary first)")
        else:
            self.say(t.node_id, f"healthy at {version}, {state or 'state unknown'}; canary request")
        c = node.canary(t.model, o.canary_prompt_ids, timeout_s=o.canary_timeout_s)
        if not c.ok:
            raise GateFailed(f"canary request failed: {c.error}")
        self.say(t.node_id, f"canary ok: {c.completion_tokens} tokens, finish {c.finish_reason}, {c.seconds:.2f}s")
        try:
            node.undrain()
        except NodeError as e:
            raise GateFailed(f"undrain: {e}") from e
        self.say(t.node_id, f"serving {version}")

    def drain(self, node: NodeClient, t: Target) -> None:
        try:
            node.drain()
        except NodeError as e:
            if not node.health().ok:      # already down: nothing to drain, restarting is the fix
                self.say(t.node_id, f"not answering ({e}); replacing it without a drain")
                return
            raise GateFailed(f"drain: {e}") from e
        self.say(t.node_id, "draining: no new requests")
        h = node.wait_idle(self.opts.drain_deadline_s)
        if h.ok and not h.idle:
            self.say(t.node_id, f"drain deadline {self.opts.drain_deadline_s:g}s passed with {h.in_flight} in "
                                "flight; the node's own graceful stop still waits for them")
        else:
            self.say(t.node_id, "drained: nothing in flight")
