"""`edgeinfer` command line: dispatches to the package that owns each subcommand.

  edgeinfer model import SRC.gguf DST      (backend.cli)
  edgeinfer model quantize SRC DST ...     (backend.cli)
  edgeinfer backend ...                    (backend.cli)
  edgeinfer gateway --config ...           (gateway.cli)
  edgeinfer serve                          (ops.serve: valkey + one backend + the gateway, default model)
  edgeinfer ops ...                        (ops.commands)
"""

from __future__ import annotations

import importlib
import sys

_OWNERS = {"model": "edgeinfer.backend.cli", "backend": "edgeinfer.backend.cli", "gateway": "edgeinfer.gateway.cli",
           "serve": "edgeinfer.ops.serve", "ops": "edgeinfer.ops.commands"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd = argv[0]
    if cmd not in _OWNERS:
        print(f"edgeinfer: unknown command {cmd!r}; expected one of: {', '.join(_OWNERS)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(_OWNERS[cmd])
    return int(mod.run(cmd, argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
