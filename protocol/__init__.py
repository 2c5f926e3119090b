"""Torch-free contracts shared by gateway, backend, cache_store and ops.

  wire.py       the backend's internal API (GenerateRequest, StreamChunk, BackendInfo, ...), msgspec
  tokenizer.py  tokenizer + chat template (the gateway's token ids equal the engine's)
  page_id.py    page identity: seeded, namespace-salted chained xxh3-128 hashes of full pages
  defaults.py   deployment defaults every tier must agree on (cache seed, Redis key prefix, page size)

Nothing here imports torch (tests/test_torch_free.py).
"""
