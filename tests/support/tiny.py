"""A tiny random Llama checkpoint (transformers' own classes, saved as safetensors) and an engine driven on the
test's thread, step by step, so a test can act between two steps."""

from __future__ import annotations

from pathlib import Path

import torch

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams, TenantSpec

VOCAB = 300


def tiny_llama(path: Path, seed: int = 0) -> Path:
    """2 layers, 8 heads over 2 KV heads, weights scaled x3 (sharp logits: greedy choices rarely tie)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                                     tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0) if p.dim() == 2 else None
    m.save_pretrained(path, safe_serialization=True)
    return path


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


class Stepper:
    """Requests submitted straight to the engine's scheduler; the test calls step() (or run()) itself."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng = eng
        self.tokens: dict[str, list[int]] = {}
        self.top: dict[str, list[list[tuple[int, float]]]] = {}
        self.finish: dict[str, str | None] = {}
        self.seqs: dict[str, Sequence] = {}

    def add(self, rid: str, ids: list[int], max_tokens: int, ns: str = "t", tenant: str | None = None,
            top_logprobs: int = 0) -> Sequence:
        toks: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        self.tokens[rid], self.top[rid], self.finish[rid] = toks, tops, None

        def emit(chunk, rid=rid) -> None:
            toks.extend(chunk.token_ids)
            tops.extend(lp.top for lp in chunk.logprobs or [])
            if chunk.finish_reason is not None:
                self.finish[rid] = chunk.finish_reason

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=top_logprobs > 0,
                            top_logprobs=top_logprobs)
        req = GenerateRequest(rid, ids, sp, ns, tenant=TenantSpec(tenant) if tenant else None)
        seq = self.eng._make_seq(req, emit)
        self.eng._seqs[rid] = seq
        self.eng.scheduler.add(seq)
        self.seqs[rid] = seq
        return seq

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            if self.eng.scheduler.has_work:
                self.eng.step()
                self.eng._flush()

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.eng.scheduler.has_work:
                return
            self.step()
        raise AssertionError(f"still running after {max_steps} steps")


def engine(model, **cfg) -> LLMEngine:
    cfg.setdefault("max_num_batched_tokens", 64)
    return LLMEngine(model, None, EngineConfig(**cfg))


def solo(model, ids: list[int], max_tokens: int, top_logprobs: int = 0, **cfg) -> tuple[list[int], list]:
    """The request served alone on a fresh engine with no prefix cache: (tokens, top logprobs per token)."""
    s = Stepper(engine(model, enable_prefix_cache=False, **cfg))
    s.add("solo", ids, max_tokens, top_logprobs=top_logprobs)
    s.run()
    return s.tokens["solo"], s.top["solo"]
