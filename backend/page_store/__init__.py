"""The backend's side of the shared prefix cache: publish filled pages, fetch a prompt's pages before it runs,
register the node; through the engine's KV port only (backend/engine/kv_port.py). bridge.py says how the parts
fit."""
