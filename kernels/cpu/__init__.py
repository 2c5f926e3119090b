"""CPU kernels for GGUF-quantized weights (C++, AVX2/FMA/F16C), built on first use with
torch.utils.cpp_extension into torch's extensions dir (one compile per source change, ~1 min).

Ops (every one has a pure-torch reference with the same signature in kernels.cpu.reference):

  q8_quantize(x [M, K] fp32) -> q [M, K] int8, d [M, K/32] fp32, s [M, K/32] fp32     (llama.cpp's Q8_1)
  q4_1_gemm(x [M, K] fp32, blocks [N, K/32*20] uint8) -> [M, N] fp32                   (int8 dots, M small)
  q8_0_gemm(x [M, K] fp32, qweight [N, K] int8, scales [N, K/32] fp16) -> [M, N] fp32
  q4_1_dequant(blocks, out [N, K] fp32) -> out                                         (then a dense GEMM)
  q8_0_dequant(qweight, scales, out [N, K] fp32) -> out
  q4_1x8_gemm(x, packed [ceil(N/8), K/32*160] uint8, n) -> [M, n] fp32               (8 weight rows interleaved)
  q4_1x8_gemm_residual(x, packed, n, tau=0.0) -> [M, n] fp32
      (x in two int8 passes: q(x) at scale d, then x - deq(q(x)) in steps of d / 256, each block's two integer
       dots combined in int32 (256 * hi + lo) inside the tile: ~15-bit activations; tau > 0: the second pass only on the blocks whose first-pass scale is at least tau
       times the row's largest (the rest stay at one pass, and the tiles skip their zero blocks); what the
       served model runs by default, see activations() and second_pass_tau())
  q8_0x8_gemm(x, qs [ceil(N/8), K/32*256] int8, d [ceil(N/8), K/32*8] fp16, n) -> [M, n] fp32
  q8_0x8_gemm_exact(x, qs, d, n, idx [C] int64, wo [ceil(N/8), C, 8] fp32) -> [M, n] fp32
      (the channels idx zeroed before the int8 quantization and added back in fp32 against the exact weight
       columns wo = q8_0x8_columns(qs, d, idx): outlier channels no longer coarsen their blocks' scale)
  q4_1x8_dequant(packed, n, out [n, K] fp32) -> out
  q8_0x8_dequant(qs, d, row0, out [rows, K] fp32) -> out                               (rows row0 .. row0+rows)

`blocks` is GGUF's Q4_1 block (fp16 d, fp16 m, 16 bytes: byte j = q[j] | q[j+16] << 4; w = d * q + m),
built once from our layout by pack_q4_1. A Q4_0 weight is the same with m = -8 d.
The x8 layouts (pack_q4_1x8, pack_q8_0x8) interleave 8 weight rows per block, as llama.cpp's "repack": one
int8 maddubs then computes 8 output columns for an activation row, and a tile of activation rows reuses the
weight registers (kernels/cpu/q4.cpp's header has the byte layout).

EDGEINFER_CPU_KERNELS=auto (default) | ext | torch picks the CPU path of the native INT4 model:
auto uses these kernels where `unavailable_reason()` is None and otherwise torch's int4 GEMM with one
logged warning; ext requires them (an error naming the reason); torch never builds them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from edgeinfer.kernels.w4a16_gemm import unpack_uint4

log = logging.getLogger(__name__)

MODE_ENV = "EDGEINFER_CPU_KERNELS"
MODES = ("auto", "ext", "torch")
ACTIVATIONS_ENV = "EDGEINFER_CPU_ACTIVATIONS"
ACTIVATIONS = ("int8x2", "int8")   # the Q4 linears' activations: two int8 passes (default) or one (llama.cpp's)
SECOND_PASS_ENV = "EDGEINFER_CPU_SECOND_PASS"
SECOND_PASS_DEFAULT = 0.0   # int8x2's second pass: the blocks whose scale is >= this x the row's largest
SOURCE = Path(__file__).with_name("q4.cpp")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-g0"]
LDFLAGS = ["-fopenmp"]   # at::parallel_for is inline OpenMP: without it the kernels run on one thread; the
                         # soname libgomp.so.1 resolves to the copy torch already loaded, so one pool
BLOCK = 32
Q4_1_BLOCK_BYTES = 20
X8 = 8


class KernelUnavailable(RuntimeError):
    pass


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto")
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}; expected one of {', '.join(MODES)}")
    return value


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def unavailable_reason() -> str | None:
    """None where the kernels can be built and run here; else why not (the capability check)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"CPU architecture {platform.machine()} (the kernels are x86-64 AVX2)"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return f"this CPU lacks {', '.join(sorted(missing))} (per /proc/cpuinfo)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH; set CXX)"
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@functools.cache
def _ops():
    """Build (first time, cached in torch's extensions dir) and load the extension; its ops namespace."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(f"edgeinfer CPU kernels unavailable: {reason}")
    build_extension("edgeinfer_cpu_q4", SOURCE)
    return torch.ops.edgeinfer_cpu


def build_extension(name: str, source: Path) -> None:
    """torch's JIT build of one C++ source (cached in torch's extensions dir), with a line before and after:
    the first build takes about a minute on 2 cores and would otherwise be silence."""
    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    fresh = built.exists() and built.stat().st_mtime >= source.stat().st_mtime
    if fresh and not os.access(build_dir, os.W_OK):   # built into a read-only image (deploy/k8s): load it as is
        torch.ops.load_library(str(built))
        return
    with _build_lock(build_dir):
        if not fresh:
            log.info("kernels/cpu: compiling %s (first start after an install or change; about a minute with "
                     "g++)", source.name)
        t0 = time.monotonic()
        load(name=name, sources=[str(source)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, is_python_module=False,
             verbose=False)
    if not fresh:
        log.info("kernels/cpu: %s ready in %.0f s", source.name, time.monotonic() - t0)


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an flock on the build directory while torch builds in it. torch's own `lock` file (a FileBaton)
    is left behind when a build is killed (Ctrl-C during the first start), and the next build then waits on
    it forever; an flock dies with its holder. So, holding ours, a `lock` file found is stale: removed, with
    one line naming it. Another live process building the same extension is waited for, with one line."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "edgeinfer.flock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("kernels/cpu: another process is building %s; waiting for it", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("kernels/cpu: removing a stale build lock left by an interrupted compile: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def _auto_available() -> bool:
    try:
        _ops()
    except (KernelUnavailable, RuntimeError, OSError) as e:   # the build's own failure text is in e
        log.warning("%s; the INT4 model runs on torch's int4 GEMM instead (slower at decode). %s=torch "
                    "silences this.", e, MODE_ENV)
        return False
    return True


def enabled() -> bool:
    """Whether the native INT4 model runs on these kernels on CPU (MODE_ENV, read at each model prepack).
    auto falls back to torch's int4 GEMM, with one logged warning, where they are unavailable or fail to build;
    ext raises KernelUnavailable (or the build's error) instead."""
    m = mode()
    if m == "torch":
        return False
    if m == "ext":
        _ops()
        return True
    return _auto_available()


_scratch = threading.local()


def scratch(n: int, k: int) -> torch.Tensor:
    """A reused fp32 [n, k] buffer, one per thread (grown to the largest weight asked for): the dequantized
    weight of one layer at a time, never a permanent fp32 copy of the model."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n * k:
        buf = _scratch.buf = torch.empty(n * k, dtype=torch.float32)
    return buf[: n * k].view(n, k)


def ops():
    return _ops()


def pack_q4_1(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """Our layout (qweight [N, K/2], low nibble = even k; scales, mins [N, K/group] fp16; group a multiple of
    32) -> GGUF Q4_1 blocks [N, K/32 * 20] uint8, values bit for bit (a group of 64 is two blocks with the
    same d and m)."""
    if group_size % BLOCK:
        raise ValueError(f"pack_q4_1: group_size {group_size} is not a multiple of {BLOCK}")
    q = unpack_uint4(qweight)
    n, k = q.shape
    nb = k // BLOCK
    q = q.reshape(n, nb, BLOCK)
    qs = q[..., :16] | (q[..., 16:] << 4)                                        # [n, nb, 16]
    rep = group_size // BLOCK
    d = scales.to(torch.float16).repeat_interleave(rep, dim=1).contiguous().view(torch.uint8)   # [n, nb * 2]
    m = mins.to(torch.float16).repeat_interleave(rep, dim=1).contiguous().view(torch.uint8)
    return torch.cat([d.reshape(n, nb, 2), m.reshape(n, nb, 2), qs], dim=-1).reshape(n, nb * Q4_1_BLOCK_BYTES)


def q8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ops().q8_quantize(x)


def q4_1_gemm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return _ops().q4_1_gemm(x, blocks)


def q8_0_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _ops().q8_0_gemm(x, qweight, scales)


def q4_1_dequant(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _ops().q4_1_dequant(blocks, out)


def q8_0_dequant(qweight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _ops().q8_0_dequant(qweight, scales, out)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % X8
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_q4_1x8(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks [N, nb * 20] -> the interleaved layout [ceil(N/8), nb * 160] (rows past N zero): per
    block fp16 d[8], fp16 m[8], then chunk j (0..3) = bytes 4j..4j+3 of each row's 16 nibble bytes."""
    nb = blocks.shape[1] // Q4_1_BLOCK_BYTES
    b = _pad_rows(blocks).reshape(-1, X8, nb, Q4_1_BLOCK_BYTES).transpose(1, 2)          # [G, nb, 8, 20]
    g = b.shape[0]
    qs = b[..., 4:].reshape(g, nb, X8, 4, 4).transpose(2, 3)                             # [G, nb, j, r, 4]
    return torch.cat([b[..., 0:2].reshape(g, nb, 16), b[..., 2:4].reshape(g, nb, 16), qs.reshape(g, nb, 128)],
                     dim=-1).reshape(g, nb * 160).contiguous()


def unpack_q4_1x8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_q4_1x8: GGUF Q4_1 blocks [n, nb * 20]."""
    g, nb = packed.shape[0], packed.shape[1] // 160
    p = packed.reshape(g, nb, 160)
    d, m = p[..., 0:16].reshape(g, nb, X8, 2), p[..., 16:32].reshape(g, nb, X8, 2)
    qs = p[..., 32:].reshape(g, nb, 4, X8, 4).transpose(2, 3).reshape(g, nb, X8, 16)
    b = torch.cat([d, m, qs], dim=-1).transpose(1, 2)                                   # [G, 8, nb, 20]
    return b.reshape(g * X8, nb * Q4_1_BLOCK_BYTES)[:n].contiguous()


def pack_q8_0x8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 int8 [N, K] + fp16 scales [N, K/32] -> qs [ceil(N/8), nb * 256] int8 (chunk c = int8 k 4c..4c+3 of
    each of the 8 rows), d [ceil(N/8), nb * 8] fp16."""
    k = qweight.shape[1]
    nb = k // BLOCK
    q = _pad_rows(qweight).reshape(-1, X8, nb, 8, 4)                                     # [G, r, nb, c, 4]
    g = q.shape[0]
    qs = q.permute(0, 2, 3, 1, 4).reshape(g, nb * 256).contiguous()
    d = _pad_rows(scales.to(torch.float16)).reshape(g, X8, nb).transpose(1, 2).reshape(g, nb * X8).contiguous()
    return qs, d


def q8_0x8_rows(qs: torch.Tensor, d: torch.Tensor, rows: torch.Tensor | None = None,
                n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a pack_q8_0x8 table back in the plain form: int8 [len, K], fp16 scales [len, K/32] (all n rows
    where rows is None)."""
    g, nb = qs.shape[0], qs.shape[1] // 256
    if rows is None:
        rows = torch.arange(g * X8 if n is None else n)
    gi, li = rows // X8, rows % X8
    q = qs.view(g, nb, 8, X8, 4)[gi, :, :, li, :]                                       # [len, nb, c, 4]
    s = d.view(g, nb, X8)[gi, :, li]                                                    # [len, nb]
    return q.reshape(rows.shape[0], nb * BLOCK), s


def q8_0x8_columns(qs: torch.Tensor, d: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Columns idx [C] of a pack_q8_0x8 table, dequantized exactly (int8 * fp16 scale is exact in fp32), in
    q8_0x8_gemm_exact's layout [G, C, 8] (padded rows: zeros)."""
    g, nb = qs.shape[0], qs.shape[1] // 256
    b, c, j = idx // BLOCK, idx % BLOCK // 4, idx % 4                                   # k = 32 b + 4 c + j
    q = qs.view(g, nb, 8, X8, 4)[:, b, c, :, j]                                         # [C, G, 8]: only those bytes
    s = d.view(g, nb, X8)[:, b, :]                                                      # [G, C, 8]
    return (q.permute(1, 0, 2).float() * s.float()).contiguous()


def q8_0x8_gemm_exact(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, n: int, idx: torch.Tensor,
                      wo: torch.Tensor) -> torch.Tensor:
    return _ops().q8_0x8_gemm_exact(x, qs, d, n, idx, wo)


def q4_1x8_gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _ops().q4_1x8_gemm(x, packed, n)


def q4_1x8_gemm_residual(x: torch.Tensor, packed: torch.Tensor, n: int, tau: float = 0.0) -> torch.Tensor:
    return _ops().q4_1x8_gemm_residual(x, packed, n, tau)


def q4_1x8_moe_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, offsets: torch.Tensor,
                    residual: bool, tau: float = 0.0) -> torch.Tensor:
    """Rows of x sorted by expert (expert e: rows offsets[e] .. offsets[e+1]) against packed [E, ceil(n/8), K/32 *
    160] (pack_q4_1x8 per expert), all experts in one call -> [M, n]; residual: two int8 activation passes (tau:
    as q4_1x8_gemm_residual's)."""
    return _ops().q4_1x8_moe_gemm(x, packed, n, offsets, residual, tau)


def q4_1x8_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gu: torch.Tensor, w_dn: torch.Tensor,
               inter: int, residual: bool, tau: float = 0.0) -> torch.Tensor:
    """A layer's routed experts in one call: x [T, H] fp32, ids / weights [T, k] (int64 / fp32), w_gu [E, ceil(2I/8),
    H/32 * 160] (gate rows, then up), w_dn [E, ceil(H/8), I/32 * 160] -> sum_j weights[t, j] *
    down(silu(gate(x[t])) * up(x[t])) [T, H] (kernels/cpu/reference.py: q4_1x8_moe)."""
    return _ops().q4_1x8_moe(x, ids, weights, w_gu, w_dn, inter, residual, tau)


def activations() -> str:
    """How the Q4 linears quantize their activations ($EDGEINFER_CPU_ACTIVATIONS, read at each model prepack):
    int8x2 (default) runs q4_1x8_gemm_residual, int8 runs q4_1x8_gemm (one pass, as llama.cpp's Q8_1).
    Measured on the default model (benchmarks/quality/chat_agreement.py, docs/QUANTIZATION.md): one pass gives
    the same 32-token greedy answer as the fp32-dequantized GGUF on about half of 100 chat prompts, two on
    nearly nine in ten."""
    value = os.environ.get(ACTIVATIONS_ENV, "int8x2")
    if value not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_ENV}={value!r}; expected one of {', '.join(ACTIVATIONS)}")
    return value


def second_pass_tau() -> float:
    """Which blocks of a row get the second int8 pass ($EDGEINFER_CPU_SECOND_PASS, read at each model prepack):
    those whose first-pass scale is at least this fraction of the row's largest; 0 gives every block two passes,
    1 only the blocks at the row's largest scale. A block's rounding error is up to d / 2 per value, so the
    blocks with the largest scale d carry most of the error (docs/QUANTIZATION.md has what each value costs
    and keeps)."""
    raw = os.environ.get(SECOND_PASS_ENV, str(SECOND_PASS_DEFAULT))
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{SECOND_PASS_ENV}={raw!r}; expected a number in [0, 1] (0: every block two passes)")
    return value


def q8_0x8_gemm(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, n: int) -> torch.Tensor:
    return _ops().q8_0x8_gemm(x, qs, d, n)


def q4_1x8_dequant(packed: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    return _ops().q4_1x8_dequant(packed, n, out)


def q8_0x8_dequant(qs: torch.Tensor, d: torch.Tensor, row0: int, out: torch.Tensor) -> torch.Tensor:
    return _ops().q8_0x8_dequant(qs, d, row0, out)


ISA_NAMES = ("avx2", "avx-vnni", "avx512-vnni-256", "avx512-vnni-512")


def x8_isa(isa: int = -1) -> int:
    """The instruction set the x8 GEMMs use (an index into ISA_NAMES: 0 AVX2 maddubs, 1 AVX-VNNI, 2 AVX512-VNNI
    on 256-bit vectors, 3 on 512-bit vectors: two x8 groups at once), the best this CPU has by default; `isa >= 0` selects min(isa, best) for the process.
    Every level computes the same integer block dots and the same float ops: bit-identical outputs."""
    return int(_ops().x8_isa(isa))


def x8_z_min_rows(rows: int = -1) -> int:
    """The fewest activation rows at which level 3 (512-bit) runs; fewer rows use level 2. `rows >= 0` sets it."""
    return int(_ops().x8_z_min_rows(rows))
