import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cache_store_does_not_import_torch():
    code = ("import sys; import edgeinfer.cache_store.codec, edgeinfer.cache_store.store, edgeinfer.cache_store.index, "
            "edgeinfer.cache_store.registry, edgeinfer.cache_store.resilience, edgeinfer.protocol.page_id; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
