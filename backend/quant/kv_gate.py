"""The KV format a node serves, chosen per model by measured accuracy (`--kv-dtype auto`, the default).

At a model's first start each candidate format (CANDIDATES: int8 and fp8 e4m3 at 1 byte + a bf16 scale per
token-head, bf16 at 2 bytes) is scored against the model's exact KV (fp32 pages): one teacher-forced forward of a
calibration window through the engine's own paged pool and kernels (quant.calib.paged_prefill), the mean KL
divergence of each position's next-token distribution from the fp32-KV one, the same-top-1 rate and the perplexity
ratio. The most compact format whose mean KLD stays within the budget is served (of the same bytes, the lower KLD);
if none is, fp32 (exact). The budget is `--kv-kld-budget` (DEFAULT_BUDGET nats).

Calibration: CPython's Lib/pydoc_data/topics.py (the language reference's prose), CALIB_TOKENS tokens from its
middle: not the project's evaluation text (idlelib/NEWS.txt) nor quality.kv's second text (the licenses).

The measurement is cached (GateCache): beside the model as kv_gate.json where the directory is writable, and by
fingerprint in $EDGEINFER_HOME/kv_gate/ and the user's cache (~/.cache/edgeinfer/kv_gate/) either way, keyed by the model's fingerprint, its
dtype and device, the calibration and the candidates; the budget is applied afresh at every start. A format the
operator forces is served as forced, and its measured cost (against fp32) is logged beside it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from edgeinfer.backend.engine.kv_pool import KVFormat
from edgeinfer.backend.model.decoder import DecoderModel
from edgeinfer.backend.quant.calib import paged_prefill
from edgeinfer.protocol.defaults import DEFAULT_KV_KLD_BUDGET, home_dir

log = logging.getLogger("edgeinfer.kv_gate")

CANDIDATES = ("int8", "fp8_e4m3", "bf16")   # compared against fp32; fp32 is the exact fallback
EXACT = "fp32"
DEFAULT_BUDGET = DEFAULT_KV_KLD_BUDGET   # nats of mean KLD vs fp32 KV (docs/QUANTIZATION.md: where it sits, why)
CALIB_TOKENS = 512
CALIBRATION = "pydoc_topics_mid_v1"
GATE_VERSION = 1


@dataclass(frozen=True)
class FormatCost:
    """One KV format's measured cost against fp32 KV on the calibration window."""
    ident: str                 # as served (KVFormat.ident: int8_hadamard, mla_int8, ...)
    bytes_per_token: int
    kld_mean: float
    kld_p99: float
    same_top1: float           # fraction of positions whose argmax equals fp32 KV's
    ppl_ratio: float


def calibration_ids(tokenizer, vocab_size: int, n: int) -> list[int]:
    """n token ids of the calibration text (ids past the model's vocab folded into it: tiny test models)."""
    import pydoc_data.topics as topics  # noqa: PLC0415  (a large module: only when measuring)

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    mid = len(text) // 2
    ids = tokenizer.encode(text[mid: mid + 12 * n])
    if len(ids) < n:
        raise ValueError(f"calibration text gave {len(ids)} tokens, {n} needed")
    return [i % vocab_size for i in ids[:n]]


def logprobs(model: DecoderModel, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """One teacher-forced forward of ids through the engine's paged pool in kv_dtype -> log-probs [n, vocab]."""
    with torch.inference_mode():
        hidden = paged_prefill(model, [ids], kv_dtype, 16)
        return torch.log_softmax(model.compute_logits(hidden).float(), -1)


def position_scores(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    """ref, got: [n, vocab] log-probabilities of the same positions (ids: the tokens that were fed) -> per position
    (on the CPU): kld = KL(ref || got), top1 = argmax agreement, and the next-token NLL under each (nll_ref, nll)."""
    nxt = torch.tensor(ids[1:], device=ref.device)
    return {"kld": (ref.exp() * (ref - got)).sum(-1).clamp_min(0).cpu(),
            "top1": (ref.argmax(-1) == got.argmax(-1)).float().cpu(),
            "nll_ref": -ref[:-1].gather(1, nxt[:, None])[:, 0].cpu(), "nll": -got[:-1].gather(1, nxt[:, None])[:, 0].cpu()}


def cost_against(ref: torch.Tensor, got: torch.Tensor, ids: list[int], ident: str, bpt: int) -> FormatCost:
    """ref, got: [n, vocab] log-probabilities of the same positions (ids: the tokens that were fed)."""
    p = position_scores(ref, got, ids)
    return FormatCost(ident=ident, bytes_per_token=bpt, kld_mean=float(p["kld"].mean()),
                      kld_p99=float(p["kld"].quantile(0.99)), same_top1=float(p["top1"].mean()),
                      ppl_ratio=math.exp(float(p["nll"].mean() - p["nll_ref"].mean())))


def measure(model: DecoderModel, ids: list[int], formats: tuple[str, ...] = CANDIDATES) -> dict[str, FormatCost]:
    """Each format's cost against fp32 KV on the window `ids`, through the engine's paged pool."""
    c = model.cfg
    ref = logprobs(model, ids, EXACT)
    out = {}
    for name in formats:
        fmt = KVFormat.resolve(name, model.dtype, latent=c.mla is not None, head_dim=c.head_dim)
        bpt = fmt.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim)   # MLA: num_kv_heads 1, the latent row
        out[name] = cost_against(ref, logprobs(model, ids, name), ids, fmt.ident, bpt)
    return out


def pick(costs: dict[str, FormatCost], budget: float) -> str:
    """The most compact format within the budget (ties in bytes: the lower KLD), else fp32."""
    ok = [(c.bytes_per_token, c.kld_mean, name) for name, c in costs.items() if c.kld_mean <= budget]
    return min(ok)[2] if ok else EXACT


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/edgeinfer, else ~/.cache/edgeinfer, whatever EDGEINFER_HOME says: a model imported again
    under another EDGEINFER_HOME has the same fingerprint and needs no second measurement."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer"


class GateCache:
    """Measured costs by key, in JSON files: beside the model when its directory is writable, and by the model's
    fingerprint in $EDGEINFER_HOME and in the user's cache either way (a read-only model directory, or the same
    checkpoint imported again elsewhere)."""

    def __init__(self, model_dir: Path, fingerprint: str) -> None:
        name = Path("kv_gate") / f"{fingerprint}.json"
        paths = [model_dir / "kv_gate.json", home_dir() / name, user_cache_dir() / name]
        self.paths = list(dict.fromkeys(paths))

    def get(self, key: str) -> dict[str, FormatCost] | None:
        for p in self.paths:
            try:
                entry = json.loads(p.read_text()).get(key)
                if entry is not None:
                    return {name: FormatCost(**c) for name, c in entry.items()}
            except (OSError, ValueError, TypeError):
                continue
        return None

    def put(self, key: str, costs: dict[str, FormatCost]) -> None:
        for p in self.paths:
            try:
                data = json.loads(p.read_text()) if p.is_file() else {}
                data[key] = {name: asdict(c) for name, c in costs.items()}
                p.parent.mkdir(parents=True, exist_ok=True)
                tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                tmp.replace(p)
            except (OSError, ValueError):
                continue


@dataclass(frozen=True)
class GateDecision:
    served: str                        # a KV_DTYPES name, what the engine is built with
    requested: str                     # auto or the forced name
    budget: float
    measured: dict[str, FormatCost]    # empty when nothing was measured
    seconds: float                     # spent measuring at this start (0: from the cache)
    tokens: int = CALIB_TOKENS         # the calibration window (the model's context, if shorter)

    def report(self) -> dict:
        return {"requested": self.requested, "served": self.served, "budget_kld": self.budget,
                "calibration": f"{CALIBRATION} ({self.tokens} tokens)", "measure_s": round(self.seconds, 2),
                "measured": {n: asdict(c) for n, c in self.measured.items()}}


def decide(model: DecoderModel, tokenizer, model_dir: Path, fingerprint: str, requested: str,
           budget: float = DEFAULT_BUDGET) -> GateDecision:
    """The format to serve: `auto` -> pick() over the measured candidates; a forced name -> itself, measured.
    A budget of 0 measures nothing: `auto` serves fp32 (no loss allowed), a forced name is served unmeasured."""
    if budget < 0 or not math.isfinite(budget):
        raise ValueError(f"kv_kld_budget={budget!r} is invalid: expected a finite number >= 0 (nats)")
    if requested != "auto":
        KVFormat(requested)                        # a bad name raises, naming it
    formats = CANDIDATES if requested == "auto" else (requested,)
    if requested == EXACT or budget == 0:
        return GateDecision(EXACT if requested == "auto" else requested, requested, budget, {}, 0.0)
    n = min(CALIB_TOKENS, model.cfg.max_position_embeddings)
    key = f"v{GATE_VERSION}|{model.dtype}|{model.device}|{CALIBRATION}|{n}"
    cache = GateCache(model_dir, fingerprint)
    cached = cache.get(key) or {}
    missing = tuple(f for f in formats if f not in cached)
    t0 = time.monotonic()
    if missing:
        cached = {**cached, **measure(model, calibration_ids(tokenizer, model.cfg.vocab_size, n), missing)}
        cache.put(key, cached)
    costs = {f: cached[f] for f in formats}
    served = pick(costs, budget) if requested == "auto" else requested
    return GateDecision(served, requested, budget, costs, time.monotonic() - t0 if missing else 0.0, n)


def log_decision(d: GateDecision, model_name: str) -> None:
    log.info(json.dumps({"event": "kv_format", "model": model_name, **d.report()}))
