-- tollgate: token bucket (algorithm code 1) as GCRA (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, this file, leaky_bucket.lua,
-- fixed_window.lua, sliding_log.lua, sliding_window.lua and check.lua into one script. Only
-- check.lua reads KEYS/ARGV; this file defines the functions it dispatches to for code 1 (and,
-- through leaky_bucket.lua, code 2). Mirrors `bucket_eval` / `spend` in
-- src/limiter/algorithm.rs line for line.
--
-- KEY   one STRING per limit: the theoretical arrival time `tat` (integer microseconds since
--       the epoch); the bucket is full when tat <= now. Expires (SET PXAT) when it is full again.
-- ARGV  (per key, passed by check.lua) limit = capacity, interval = microseconds per unit
--       (1 / rate), cost = units this request takes.
-- Reply (per key, in check.lua's reply) allowed (1/0), remaining (floored units),
--       reset_us (until full), retry_after_us (0 when allowed), delay_us (0 here).

-- The stored tat, or nil (absent or of another type: `bad` is then true).
local function bucket_get(key)
  local v, bad = tg_read_key('bucket', key, 'GET')
  if not v then
    return nil, bad
  end
  return tonumber(v), false
end

-- Decide without writing. `leaky` reports the wait before forwarding as delay.
local function bucket_eval(key, now, limit, t, cost, leaky)
  local tat = bucket_get(key)
  if not tat then
    tat = now
  end
  local cap = limit * t
  local base = math.max(tat, now)
  local new_tat = base + cost * t
  if new_tat - now <= cap then
    local delay = 0
    if leaky then
      delay = base - now
    end
    return true, math.floor((cap - (new_tat - now)) / t), new_tat - now, 0, delay
  end
  return false, math.floor(math.max(cap - (base - now), 0) / t), base - now,
    new_tat - cap - now, 0
end

local function tb_eval(key, now, limit, t, cost)
  return bucket_eval(key, now, limit, t, cost, false)
end

-- Spend `cost` units: tat = max(tat, now) + cost * t; the key expires when the bucket is full.
-- SET replaces a key of any type, so a stale key of another algorithm needs no DEL.
local function tb_spend(key, now, limit, t, cost)
  local tat = bucket_get(key)
  if not tat or tat < now then
    tat = now
  end
  local new_tat = tat + cost * t
  redis.call('SET', key, new_tat, 'PXAT', tg_at_ms(new_tat))
  tg_remember('bucket', key, new_tat)
end

-- Give back `cost` units: tat -= cost * t (the expiry stays; it is then merely late).
local function tb_refund(key, now, limit, t, cost)
  local tat = bucket_get(key)
  if not tat then
    return
  end
  redis.call('SET', key, tat - cost * t, 'KEEPTTL')
  tg_forget(key)
end
