import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cache_store_does_not_import_torch():
    code = ("import sys; import cache_store.codec, cache_store.store, cache_store.index, "
            "cache_store.registry, cache_store.resilience, protocol.page_id; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
