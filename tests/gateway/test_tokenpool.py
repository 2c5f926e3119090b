"""The gateway's tokenizer process pool costs no process until a long prompt needs it (issue 15, peak RSS: an
idle ProcessPoolExecutor already ran multiprocessing's resource tracker, a ~15 MiB Python process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import asyncio, json, os, sys, time
    from edgeinfer.gateway.tokenpool import TokenizerPool

    def children():
        me = str(os.getpid())
        out = []
        for p in os.listdir("/proc"):
            try:
                stat = open(f"/proc/{p}/stat").read()
            except OSError:
                continue
            if p.isdigit() and stat[stat.rindex(")") + 2:].split()[1] == me:
                out.append(open(f"/proc/{p}/cmdline").read().replace("\\0", " ")[:120])
        return out

    async def main():
        pool = TokenizerPool({"m": sys.argv[1]}, 2)
        time.sleep(0.5)
        idle = children()
        ids = await pool.encode("m", "prompt", "x" * 20000)
        used = children()
        pool.close()
        print(json.dumps({"idle": idle, "used": used, "ids": len(ids)}))

    asyncio.run(main())
""")


def test_tokenizer_pool_starts_no_process_until_first_use(tokenizer_dir):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tokenizer_dir)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["idle"] == [], got                    # no resource tracker, no worker
    assert got["ids"] == 20000 and len(got["used"]) >= 2, got    # first use: the workers (and the tracker)
