-- tollgate: fixed window (algorithm code 3) (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, token_bucket.lua,
-- leaky_bucket.lua, this file, sliding_log.lua, sliding_window.lua and check.lua into one
-- script; check.lua dispatches code 3 to the functions below. Mirrors `fixed_eval` / `spend`
-- in src/limiter/algorithm.rs: windows aligned to the epoch, index = floor(now / window).
--
-- KEY   one HASH per limit: i = window index, c = units admitted in that window. Expires
--       (PEXPIREAT, see common.lua) at the end of window i.
-- ARGV  (per key, passed by check.lua) limit = units per window, interval = window in
--       microseconds, cost = units this request takes.
-- Reply (per key) allowed (1/0), remaining, reset_us (until the window ends),
--       retry_after_us (= reset_us when denied, else 0), delay_us (0).

-- The stored (index, count), or nil (absent, or another type: `bad` is then true).
local function fw_get(key)
  local r, bad = tg_read_key('fw', key, 'HMGET', 'i', 'c')
  if not r or not r[1] then
    return nil, 0, bad
  end
  return tonumber(r[1]), tonumber(r[2]) or 0, false
end

local function fw_eval(key, now, limit, w, cost)
  local index = math.floor(now / w)
  local i, c = fw_get(key)
  local count = 0
  if i == index then
    count = c
  end
  local reset = (index + 1) * w - now
  if count + cost <= limit then
    return true, limit - count - cost, reset, 0, 0
  end
  return false, math.max(limit - count, 0), reset, reset, 0
end

local function fw_spend(key, now, limit, w, cost)
  local index = math.floor(now / w)
  local i, c, bad = fw_get(key)
  if bad then
    redis.call('DEL', key)
  end
  if i == index then
    -- Same window: the key already expires at its end (set when the window began).
    tg_remember('fw', key, { index, redis.call('HINCRBY', key, 'c', cost) })
  else
    redis.call('HSET', key, 'i', index, 'c', cost)
    redis.call('PEXPIREAT', key, tg_at_ms((index + 1) * w))
    tg_remember('fw', key, { index, cost })
  end
end

-- Give back `cost` units if the window the check counted them in is still the stored one.
local function fw_refund(key, now, limit, w, cost)
  local index = math.floor(now / w)
  local i, c = fw_get(key)
  if i == index then
    redis.call('HSET', key, 'c', math.max(c - cost, 0))
    tg_forget(key)
  end
end
