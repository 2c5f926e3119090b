"""edgeinfer: a multi-tenant LLM inference service.

Everything installs under this one name: ``edgeinfer.gateway``, ``edgeinfer.backend``, ``edgeinfer.kernels``,
``edgeinfer.cache_store``, ``edgeinfer.ops`` and ``edgeinfer.protocol``. Their folders stay at the top of the
repository; the entries here are links to them, so no generic top-level name (``kernels``, ``backend``, ...)
is ever installed beside other packages.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("edgeinfer")
except PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"
