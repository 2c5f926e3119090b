"""Every Lua script of the gateway's admission, in one place (run by admit.py and leases.py).

Keys: `<prefix>:rl:{<tenant>}:requests|tokens` (GCRA theoretical arrival times) and `<prefix>:cc:{<tenant>}`
(the tenant's stream leases), built by cache_store.keys.KeySpace; one tenant's keys share a cluster slot.
"""

from edgeinfer.gateway.admission.ratelimit import EPS_MS

# `now`: the Redis clock in ms (every gateway shares it)
NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
"""

# GCRA over KEYS[1..n] with ARGV[1+2i] = interval, ARGV[2+2i] = cost; needs locals now, n, window, force.
# Leaves `allowed` and `out` = {allowed, retry ms, limit index, (remaining, reset ms) per limit}.
GCRA_LUA = """
local eps = """ + repr(EPS_MS) + """
local tats, news = {}, {}
local allowed, retry, by = 1, 0, 0
for i = 1, n do
  local interval = tonumber(ARGV[1 + 2 * i])
  local cost = tonumber(ARGV[2 + 2 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or now)
  if tat < now then tat = now end
  tats[i] = tat
  news[i] = tat + cost * interval
  local diff = news[i] - now
  if diff > window + eps and not force then     -- eps: float tats (ratelimit.EPS_MS)
    allowed = 0
    if diff - window > retry then retry = diff - window; by = i end
  end
end
local out = {allowed, math.ceil(retry), by}
for i = 1, n do
  local interval = tonumber(ARGV[1 + 2 * i])
  local held = tats[i] - now
  if allowed == 1 then
    held = news[i] - now
    redis.call('SET', KEYS[i], string.format('%.3f', news[i]), 'PX', math.ceil(held) + 1)
  end
  out[#out + 1] = math.floor((window - held + eps) / interval)
  out[#out + 1] = math.ceil(held)
end
"""

# KEYS: rate keys..., stream key; ARGV: n, window, (interval, cost) per limit, cap, lease id, ttl ms
ADMIT = NOW_MS + """local n = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local force = false
local cap = tonumber(ARGV[3 + 2 * n])
local cc = KEYS[n + 1]
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', cc, '-inf', now)
  if redis.call('ZCARD', cc) >= cap then return {-1} end
end
""" + GCRA_LUA + """
if allowed == 1 and cap > 0 then
  local ttl = tonumber(ARGV[5 + 2 * n])
  redis.call('ZADD', cc, math.floor(now) + ttl, ARGV[4 + 2 * n])
  redis.call('PEXPIRE', cc, ttl)
end
return out
"""

# KEYS: tokens key; ARGV: 1, window, interval, cost
CHARGE = NOW_MS + """local n = 1
local window = tonumber(ARGV[2])
local force = false
""" + GCRA_LUA + """
return out
"""

# KEYS: tokens key, stream key; ARGV: lease id ('' for none), window, interval (0: no charge), cost
FINISH = """
if ARGV[1] ~= '' then redis.call('ZREM', KEYS[2], ARGV[1]) end
if tonumber(ARGV[3]) <= 0 or tonumber(ARGV[4]) <= 0 then return 1 end
""" + NOW_MS + """local n = 1
local window = tonumber(ARGV[2])
local force = true
""" + GCRA_LUA + """
return 1
"""

REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local kept = 0
for i = 2, #ARGV do
  kept = kept + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ttl, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], ttl)
return kept
"""
