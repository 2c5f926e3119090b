"""Drive an LLMEngine on the test's own thread: requests submitted straight to its scheduler, stepped one step at a
time (Stepper: a test can act between two steps) or until all finish (generate_together, solo)."""

from __future__ import annotations

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams, TenantSpec


class Stepper:
    """Requests submitted straight to the engine's scheduler; the test calls step() (or run()) itself."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng = eng
        self.tokens: dict[str, list[int]] = {}
        self.lps: dict[str, list[float]] = {}                  # the chosen tokens' logprobs (with logprobs=True)
        self.top: dict[str, list[list[tuple[int, float]]]] = {}
        self.finish: dict[str, str | None] = {}
        self.seqs: dict[str, Sequence] = {}

    def add(self, rid: str, ids: list[int], max_tokens: int, ns: str = "t", tenant: str | None = None,
            top_logprobs: int = 0, logprobs: bool = False) -> Sequence:
        """A greedy request, EOS ignored; logprobs (or top_logprobs > 0) records each chosen token's logprob."""
        toks: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        self.tokens[rid], self.lps[rid], self.top[rid], self.finish[rid] = toks, lps, tops, None

        def emit(chunk, rid=rid) -> None:
            toks.extend(chunk.token_ids)
            lps.extend(lp.logprob for lp in chunk.logprobs or [])
            tops.extend(lp.top for lp in chunk.logprobs or [])
            if chunk.finish_reason is not None:
                self.finish[rid] = chunk.finish_reason

        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            logprobs=logprobs or top_logprobs > 0, top_logprobs=top_logprobs)
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
                self.eng.flush()

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


def generate_together(eng: LLMEngine, prompts: list[list[int]], ns: str,
                      max_tokens: list[int]) -> list[tuple[list[int], list[float], int]]:
    """Greedy, EOS ignored, logprobs on; per prompt (tokens, chosen-token logprobs, cached prompt tokens)."""
    s = Stepper(eng)
    seqs = [s.add(f"{ns}-{i}-{len(eng._seqs)}", p, m, ns=ns, logprobs=True)
            for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    s.run()
    return [(s.tokens[q.request_id], s.lps[q.request_id], q.num_cached_prompt_tokens) for q in seqs]
