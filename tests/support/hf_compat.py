"""transformers (the test oracle) next to this repo's own `kernels` package.

transformers 5.x depends on Hugging Face's `kernels` package (hub kernels) and imports it whenever its
metadata says it is installed; the import name is the same as this repo's `kernels/`, which comes first on
sys.path here, so `from transformers import LlamaForCausalLM` fails with
`cannot import name 'CUDAProperties' from 'kernels'`. The oracle never needs hub kernels: tell transformers
they are unavailable before it looks.
"""

from __future__ import annotations

import os


def hide_hub_kernels() -> None:
    os.environ["USE_HUB_KERNELS"] = "NO"    # from_pretrained would otherwise ask for them by default
    try:
        import transformers.utils as tu
        from transformers.utils import import_utils
    except ImportError:
        return

    def unavailable(*_args, **_kwargs) -> bool:
        return False

    import_utils.is_kernels_available = unavailable
    if hasattr(tu, "is_kernels_available"):
        tu.is_kernels_available = unavailable  # type: ignore[attr-defined]
