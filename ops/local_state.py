"""What `edgeinfer serve` keeps on this machine under `<home>/serve/` (home: `protocol.defaults.home_dir()`):

- `secrets.json` (0600, made once): the cache seed mixed into every page hash, the key of the page MAC and
  the embedded valkey's password. Kept, not made up per run, so pages published by one run are found, and
  their MAC accepted, by the next: a restart keeps its prefix cache.
- `running.json` (0600, while a `serve` runs): its pid, the gateway URL and the registry's Redis URL, so
  `edgeinfer ops status` on the same machine finds the node without --redis-url.
- `serve.lock`: flocked by the one `serve` that owns this home (its valkey data, node id `local-0`,
  running.json); a second `serve` on the same home is refused in one line. The flock dies with its holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from edgeinfer.protocol.defaults import home_dir


def serve_dir() -> Path:
    return home_dir() / "serve"


def _write_private(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


@dataclass(frozen=True)
class LocalSecrets:
    cache_seed: str
    page_key: str
    valkey_password: str

    @classmethod
    def load_or_create(cls, path: Path | None = None) -> LocalSecrets:
        path = path or serve_dir() / "secrets.json"
        try:
            data = json.loads(path.read_text())
            return cls(**{k: str(data[k]) for k in ("cache_seed", "page_key", "valkey_password")})
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a secrets file edgeinfer wrote ({e}); move it away to make a new "
                             "one (the pages published under the old one will miss)") from e
        made = cls(secrets.token_hex(16), secrets.token_hex(32), secrets.token_hex(16))
        _write_private(path, asdict(made))
        return made


class HomeLock:
    """The flock on `<home>/serve/serve.lock` that makes one `edgeinfer serve` the owner of its home."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def take(cls, path: Path | None = None) -> HomeLock | str:
        """The lock, or the one-line reason it is held by another serve."""
        path = path or serve_dir() / "serve.lock"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return (f"another edgeinfer serve (pid {holder}) is running with this home, {home_dir()} (its valkey "
                    "data, node id local-0 and running.json); stop it first, or give this one its own home: "
                    "EDGEINFER_HOME=/some/other/dir edgeinfer serve --port P")
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        return cls(fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)     # closing the last descriptor releases the flock
            self.fd = -1


def write_running(gateway_url: str, redis_url: str | None, path: Path | None = None) -> Path:
    path = path or serve_dir() / "running.json"
    _write_private(path, {"pid": os.getpid(), "gateway_url": gateway_url, "redis_url": redis_url})
    return path


def clear_running(path: Path | None = None) -> None:
    path = path or serve_dir() / "running.json"
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def running_redis_url(path: Path | None = None) -> str | None:
    """The Redis URL of a live `edgeinfer serve` on this machine (its running.json, if that pid is alive)."""
    path = path or serve_dir() / "running.json"
    try:
        data = json.loads(path.read_text())
        os.kill(int(data["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    url = data.get("redis_url")
    return str(url) if url else None
