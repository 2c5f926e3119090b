"""What benchmarks/gpu_check.sh needs, checked before it spends device time: python modules, CUDA, Triton,
the SmolLM2 source. Prints one line per item (ok / MISSING and what to do) and writes them as JSON.

  python -m benchmarks.harness.gpu_prereqs --out F [--cpu]

Exit 0 when the essentials are there (--cpu: no CUDA needed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from pathlib import Path

ESSENTIAL = ("torch", "triton", "numpy", "safetensors", "tokenizers", "xxhash", "msgspec", "pytest")
OPTIONAL = {   # module -> what is lost without it
    "transformers": "the SmolLM2 parity test (transformers is the reference)",
    "gguf": "importing SmolLM2 from a carried GGUF (engine steps then run on random weights)",
    "pytest_timeout": "pytest's per-test timeout from pyproject (the script's per-step timeouts still hold)",
}
WHEELS_HINT = ("carry it as a wheel: bash benchmarks/gpu_check.sh --prepare puts msgspec and gguf wheels under "
               ".gpucarry/common/wheels, which the script installs with pip --no-index")


def check_module(name: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(name)
    except Exception as e:   # ImportError, or a broken install raising something else
        return False, f"{type(e).__name__}: {e}"
    return True, str(getattr(mod, "__version__", ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="dry run: no CUDA device expected")
    args = ap.parse_args()
    items: dict[str, dict] = {}
    ok = True
    for name in ESSENTIAL:
        found, info = check_module(name)   # triton too on CPU: the dry run drives its interpreter
        items[name] = {"ok": found, "info": info, "essential": True}
        ok &= found
        if not found:
            items[name]["fix"] = WHEELS_HINT
    for name, loss in OPTIONAL.items():
        found, info = check_module(name)
        items[name] = {"ok": found, "info": info, "essential": False}
        if not found:
            items[name]["without"] = loss
    env = {"python": platform.python_version(), "machine": platform.machine()}
    if items["torch"]["ok"]:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = str(torch.version.cuda)
        cuda = torch.cuda.is_available()
        items["cuda_device"] = {"ok": cuda or args.cpu, "essential": not args.cpu,
                                "info": torch.cuda.get_device_name() if cuda else "torch sees no CUDA device"}
        if not (cuda or args.cpu):
            items["cuda_device"]["fix"] = "run on the GPU machine, or bash benchmarks/gpu_check.sh --cpu-dry-run here"
        if cuda:
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        ok &= cuda or args.cpu
    for name, it in items.items():
        state = "ok" if it["ok"] else ("MISSING" if it["essential"] else "missing (optional)")
        extra = it.get("fix") or it.get("without") or ""
        print(f"  {name:16s} {state:20s} {it['info'][:70]}" + (f"\n  {'':16s} -> {extra}" if not it["ok"] else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ok": ok, "items": items, "env": env}, indent=2) + "\n")
    print("prerequisites: " + ("ok" if ok else "MISSING essentials (above): the steps that need them will fail"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
