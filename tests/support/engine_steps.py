"""Drive an LLMEngine on the test's own thread: submit requests together, step until all finish."""

from __future__ import annotations

from edgeinfer.backend.engine.engine import LLMEngine
from edgeinfer.protocol.wire import GenerateRequest, SamplingParams


def generate_together(eng: LLMEngine, prompts: list[list[int]], ns: str,
                      max_tokens: list[int]) -> list[tuple[list[int], list[float], int]]:
    """Greedy, EOS ignored, logprobs on; per prompt (tokens, chosen-token logprobs, cached prompt tokens)."""
    outs: list[tuple[list[int], list[float]]] = []
    seqs = []
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        ids: list[int] = []
        lps: list[float] = []
        outs.append((ids, lps))

        def emit(chunk, ids=ids, lps=lps) -> None:
            ids += chunk.token_ids
            lps += [lp.logprob for lp in chunk.logprobs or []]

        sp = SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=True)
        seq = eng._make_seq(GenerateRequest(f"{ns}-{i}-{len(eng._seqs)}", p, sp, ns), emit)
        eng._seqs[seq.request_id] = seq
        eng.scheduler.add(seq)
        seqs.append(seq)
    while eng.scheduler.has_work:
        eng.step()
    return [(ids, lps, s.num_cached_prompt_tokens) for (ids, lps), s in zip(outs, seqs, strict=True)]
