"""Who makes a sequence's draft (a Proposer): n-gram lookup over the sequence's own tokens (vLLM's "ngram", prompt
lookup decoding: no extra weights) or the checkpoint's MTP layer (its prediction, made after the last step by the
driver through spec/mtp.py, kept in the sequence's SpecState until the next step asks)."""

from __future__ import annotations

from typing import Protocol

from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.backend.engine.spec.policy import SpecPolicy, state_of


class Proposer(Protocol):
    def propose(self, seq: Sequence, policy: SpecPolicy) -> list[int]:
        """Up to policy.num_tokens draft tokens for the token after seq's last (fewer near max_tokens: a verify
        emits up to k+1); [] for none."""
        ...


def room(seq: Sequence, policy: SpecPolicy) -> int:
    return min(policy.num_tokens, seq.max_new_tokens - len(seq.output_ids) - 1)


class NgramProposer:
    def propose(self, seq: Sequence, policy: SpecPolicy) -> list[int]:
        index = state_of(seq, policy).index
        assert index is not None
        ids = seq.all_ids
        index.update(ids)
        k = room(seq, policy)
        return index.propose(ids, k) if k > 0 else []


class MTPProposer:
    def propose(self, seq: Sequence, policy: SpecPolicy) -> list[int]:
        """The MTP layer's draft made after the last step, if it follows the current last token."""
        made = state_of(seq, policy).mtp
        k = room(seq, policy)
        if made is None or made[0] != seq.num_tokens or k <= 0:
            return []
        return made[1][:k]

    @staticmethod
    def keep(seq: Sequence, policy: SpecPolicy, draft: list[int]) -> None:
        """The MTP layer's draft for the token after the sequence's current last one."""
        state_of(seq, policy).mtp = (seq.num_tokens, draft)


def proposer_for(policy: SpecPolicy) -> Proposer:
    return MTPProposer() if policy.method == "mtp" else NgramProposer()
