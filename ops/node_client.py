"""One backend node as the operator sees it: its health, info, drain/undrain and a canary request.

Plain blocking HTTP (urllib): the CLI does one thing at a time and must not need an event loop.
Admin calls carry `authorization: Bearer <operator key>`; tenant keys never work there. The backends
also take the operator key on /internal/* (info, the canary), where the gateway uses its internal secret.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import NamedTuple
from urllib.parse import urlsplit

import msgspec

from edgeinfer.protocol.wire import chunk_decoder

CANARY_PROMPT_IDS = (28, 29, 30, 31, 32, 33, 34, 35)   # plain ASCII-range ids: valid in any real vocabulary


class NodeError(Exception):
    """A node did not answer as expected (unreachable, HTTP error, bad body, timeout)."""


class Health(NamedTuple):
    ok: bool
    in_flight: int = 0
    running: int = 0
    waiting: int = 0
    state: str = ""
    version: str = ""
    error: str = ""

    @property
    def idle(self) -> bool:
        return self.ok and self.in_flight == 0 and self.running == 0 and self.waiting == 0


class CanaryResult(NamedTuple):
    ok: bool
    finish_reason: str | None
    completion_tokens: int
    seconds: float
    error: str = ""


def port_of(url: str) -> int:
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


class NodeClient:
    def __init__(self, url: str, operator_key: str | None = None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.operator_key = operator_key
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: bytes | None = None, admin: bool = False,
              timeout_s: float | None = None) -> tuple[int, bytes]:
        headers = {"content-type": "application/json"}
        if admin and not self.operator_key:
            raise NodeError("no operator key: pass --operator-key or set EDGEINFER_OPERATOR_KEY")
        if self.operator_key and admin:
            headers["authorization"] = f"Bearer {self.operator_key}"
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (OSError, TimeoutError) as e:     # URLError, refused, reset, timeout
            raise NodeError(f"{self.url}{path}: {type(e).__name__}: {e}") from e

    def health(self) -> Health:
        try:
            status, body = self._call("GET", "/health", timeout_s=2.0)
        except NodeError as e:
            return Health(ok=False, error=str(e))
        try:
            d = json.loads(body)
        except ValueError:
            return Health(ok=False, error=f"/health answered {status} with a non-JSON body")
        if status != 200:
            return Health(ok=False, error=f"/health answered {status}: {d.get('error', d)}")
        return Health(True, int(d.get("in_flight", 0)), int(d.get("running", 0)), int(d.get("waiting", 0)),
                      str(d.get("state", "")), str(d.get("version", "")))

    def info(self) -> dict:
        status, body = self._call("GET", "/admin/info", admin=True)
        if status == 401:
            raise NodeError(f"{self.url} refused /admin/info: wrong or missing operator key")
        if status != 200:
            raise NodeError(f"{self.url}/admin/info answered {status}")
        return json.loads(body)

    def _admin(self, action: str) -> dict:
        status, body = self._call("POST", f"/admin/{action}", b"", admin=True)
        if status == 401:
            raise NodeError(f"{self.url} refused /admin/{action}: wrong or missing operator key")
        if status != 200:
            raise NodeError(f"{self.url}/admin/{action} answered {status}: {body[:200]!r}")
        return json.loads(body)

    def drain(self) -> dict:
        return self._admin("drain")

    def undrain(self) -> dict:
        return self._admin("undrain")

    def wait_idle(self, deadline_s: float, poll_s: float = 0.25) -> Health:
        """Poll /health until nothing is in flight twice in a row (a request may be between admission
        and the engine for one poll), the node is gone, or the deadline passes. Returns the last health."""
        end = time.monotonic() + deadline_s
        idle_polls = 0
        while True:
            h = self.health()
            if not h.ok:
                return h
            idle_polls = idle_polls + 1 if h.idle else 0
            if idle_polls >= 2 or time.monotonic() >= end:
                return h
            time.sleep(poll_s)

    def wait_healthy(self, timeout_s: float, version: str | None = None, node_id: str | None = None,
                     poll_s: float = 0.25) -> str:
        """Wait until /health is 200 and /internal/info shows the wanted version and node id.
        Returns "" on success, else why it did not get there."""
        end = time.monotonic() + timeout_s
        why = "no answer yet"
        while time.monotonic() < end:
            h = self.health()
            if h.ok:
                try:
                    info = self.info()
                except (NodeError, ValueError) as e:
                    why = str(e)
                else:
                    if version is not None and info.get("version") != version:
                        why = f"serving version {info.get('version')!r}, want {version!r}"
                    elif node_id is not None and info.get("node_id") != node_id:
                        why = f"answers as node {info.get('node_id')!r}, want {node_id!r}"
                    else:
                        return ""
            else:
                why = h.error
            time.sleep(poll_s)
        return f"not healthy after {timeout_s:g}s: {why}"

    def canary(self, model: str = "", prompt_ids: tuple[int, ...] = CANARY_PROMPT_IDS, max_tokens: int = 4,
               timeout_s: float = 60.0) -> CanaryResult:
        """One real generate request straight to the node; ok when it streams to a normal finish."""
        req = {"prompt_token_ids": list(prompt_ids), "max_tokens": max_tokens, "model": model}
        headers = {"content-type": "application/json"}
        if self.operator_key:     # /admin/canary: the operator's own endpoint (also on a drained node)
            headers["authorization"] = f"Bearer {self.operator_key}"
        http = urllib.request.Request(self.url + "/admin/canary", data=msgspec.json.encode(req),
                                      method="POST", headers=headers)
        t0 = time.monotonic()
        tokens = 0
        try:
            with urllib.request.urlopen(http, timeout=timeout_s) as r:
                for line in r:
                    if not line.strip():
                        continue
                    chunk = chunk_decoder.decode(line)
                    tokens += len(chunk.token_ids)
                    if chunk.error is not None:
                        return CanaryResult(False, chunk.finish_reason, tokens, time.monotonic() - t0, chunk.error)
                    if chunk.finish_reason is not None:
                        ok = chunk.finish_reason in ("stop", "length") and tokens > 0
                        return CanaryResult(ok, chunk.finish_reason, tokens, time.monotonic() - t0,
                                            "" if ok else f"finished with {chunk.finish_reason!r} "
                                                          f"after {tokens} tokens")
        except urllib.error.HTTPError as e:
            return CanaryResult(False, None, tokens, time.monotonic() - t0,
                                f"HTTP {e.code}: {e.read()[:200]!r}")
        except (OSError, TimeoutError, msgspec.MsgspecError) as e:
            return CanaryResult(False, None, tokens, time.monotonic() - t0, f"{type(e).__name__}: {e}")
        return CanaryResult(False, None, tokens, time.monotonic() - t0, "stream ended without a final chunk")
