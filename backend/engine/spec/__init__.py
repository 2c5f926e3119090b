"""Speculative decoding, in one room: the policy (which sequences draft, how many tokens pay: policy.py), the
proposers that make drafts (n-gram lookup and the checkpoint's MTP layer: proposers.py, the MTP layer's runner and
KV: mtp.py), verification against the target (verify.py), and the driver the engine step calls three times
(draft / accept / after_step: driver.py). A sequence's state is spec/state.py's SpecState (Sequence.spec)."""
