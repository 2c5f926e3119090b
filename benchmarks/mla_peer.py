"""MLA against llama.cpp's deepseek2 path: edgeinfer serving a DeepSeek-V2-Lite-shaped random checkpoint (MLA with
a 512 + 64 latent, 64 experts top-6; benchmarks/moe.py DS_SHAPE, 4 layers) converted by llama.cpp's own
convert_hf_to_gguf.py and llama-quantize (Q4_0, Q8_0 embedding), against llama-server on the same file, over OpenAI
HTTP, interleaved: benchmarks/moe.py's runner with --arch deepseek2.

  python -m benchmarks mla_peer [--quick] [--levels 1,8,32] [--decode-prompt-len 512] [--llamacpp-build DIR]
      [--llamacpp-src DIR] [--work DIR] [--out FILE]

Every option of `python -m benchmarks moe` applies. Writes --out (default benchmarks/results/mla_peer.json) and a
.md table. Target (issue 56): batch-1 decode >= 1.0x llama.cpp.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import moe  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in argv:
        argv += ["--out", str(ROOT / "benchmarks" / "results" / "mla_peer.json")]
    return moe.main(["--arch", "deepseek2", *argv])


if __name__ == "__main__":
    sys.exit(main())
