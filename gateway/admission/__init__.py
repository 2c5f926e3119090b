"""A tenant's admission in one place: rate limits (ratelimit.py, GCRA), concurrent-stream leases (leases.py),
the two decided together and settled at the request's end (admit.py), and every Lua script they run (lua.py).
Redis keys come from cache_store.keys.KeySpace."""

from edgeinfer.gateway.admission.admit import Admission, RedisAdmission
from edgeinfer.gateway.admission.leases import Lease
from edgeinfer.gateway.admission.ratelimit import UNLIMITED, Decision

__all__ = ["UNLIMITED", "Admission", "Decision", "Lease", "RedisAdmission"]
