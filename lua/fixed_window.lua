-- tollgate: fixed window (algorithm code 3) (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, token_bucket.lua,
-- leaky_bucket.lua, this file, sliding_log.lua, sliding_window.lua and check.lua into one
-- script; check.lua dispatches code 3 to the functions below. Mirrors `fixed_eval` / `spend` /
-- `refund` in src/limiter/algorithm.rs: windows aligned to the epoch, index = floor(now / window).
--
-- KEY   one HASH per limit: i = window index, c = units admitted in that window, q = "f:<window>"
--       (the shape it was written under). Expires (PEXPIREAT, see common.lua) at the end of
--       window i. A key of another shape (a reload changed the algorithm or the window) is
--       converted first: the units it still holds count in the current window (tg_used).
-- ARGV  (per key, passed by check.lua) limit = units per window, interval = window in
--       microseconds, cost = units this request takes.
-- Reply (per key) allowed (1/0), remaining, reset_us (until the window ends),
--       retry_after_us (= reset_us when denied, else 0), delay_us (0).

-- Write (or, in peek, only remember) a fresh window `index` holding `count` units.
local function fw_put(key, index, count, w, q)
  if TG_WRITE then
    rcall('HSET', key, 'i', tg_dec(index), 'c', tg_dec(count), 'q', q)
    rcall('PEXPIREAT', key, tg_at_ms(tg_start(index + 1, w)))
  end
  tg_remember_fields('fw', key, 3, index, count, q)
end

-- The stored (index, count) under this window, or nil; state of another shape is converted.
local function fw_get(key, now, limit, w)
  local q = tg_shape('f', w)
  local r, bad = tg_read_key('fw', key, 'HMGET', 'i', 'c', 'q')
  if not bad and (not r or not r[1]) then
    return nil, 0
  end
  if not bad and r[3] == q then
    return tonum(r[1]), tonum(r[2]) or 0
  end
  local used = mmin(tg_used(key, now, w), limit)
  local index = tg_index(now, w)
  if TG_WRITE then
    rcall('DEL', key)
  end
  if used <= 0 then
    tg_remember('fw', key, false)
    return nil, 0
  end
  fw_put(key, index, used, w, q)
  return index, used
end

local function fw_eval(key, now, limit, w, cost)
  local index = tg_index(now, w)
  local i, c = fw_get(key, now, limit, w)
  local count = 0
  if i == index then
    count = c
  end
  local reset = tg_start(index + 1, w) - now
  if count + cost <= limit then
    return true, limit - count - cost, reset, 0, 0
  end
  return false, mmax(limit - count, 0), reset, reset, 0
end

local function fw_spend(key, now, limit, w, cost)
  local index = tg_index(now, w)
  local i, c = fw_get(key, now, limit, w)
  if i == index then
    -- Same window: the key already expires at its end (set when the window began).
    tg_remember_fields('fw', key, 3, index, rcall('HINCRBY', key, 'c', tg_dec(cost)), tg_shape('f', w))
  else
    fw_put(key, index, cost, w, tg_shape('f', w))
  end
end

-- A request whose only limit is this window (no penalty, no lease; check.lua): fw_eval, then on
-- admission what fw_spend would write, from the one read (fw_spend's own read would find the
-- state fw_eval read). Returns the allowed code (1 or 0) and the reply's 4 numbers.
local function fw_check(key, now, limit, w, cost)
  local index = tg_index(now, w)
  local i, c = fw_get(key, now, limit, w)
  local count = 0
  if i == index then
    count = c
  end
  local reset = tg_start(index + 1, w) - now
  if count + cost > limit then
    return 0, mmax(limit - count, 0), reset, reset, 0
  end
  if i == index then
    -- Same window: the key already expires at its end. What a read now returns, in place of
    -- the read fw_get kept (this call's own table, referenced nowhere else).
    tg_remember_fields('fw', key, 3, index, rcall('HINCRBY', key, 'c', tg_dec(cost)), tg_shape('f', w))
  else
    fw_put(key, index, cost, w, tg_shape('f', w))
  end
  return 1, limit - count - cost, reset, 0, 0
end

-- Move the count of the window of `now` (the instant the check was decided) by `delta`, never
-- below 0, if that window is still the stored one and the key was not converted to another
-- shape since (a window that moved on no longer counts those units anyway).
local function fw_adjust(key, now, w, delta)
  local index = tg_index(now, w)
  local r = tg_read('HMGET', key, 'i', 'c', 'q')
  if r and tonum(r[1]) == index and r[3] == tg_shape('f', w) then
    rcall('HSET', key, 'c', mmax((tonum(r[2]) or 0) + delta, 0))
    tg_forget(key)
  end
end

-- Give back `cost` units counted at `now`.
local function fw_refund(key, now, limit, w, cost)
  fw_adjust(key, now, w, -cost)
end

-- Debit `cost` more units at `now` (the instant the real cost of a request came back after its
-- response, `cost_from`), without checking: into the window of `now`, which is the check's
-- window while that one lasts and otherwise the window the cost was learned in, so a debit is
-- never dropped. The count may go over the limit (the key is then denied until its window
-- ends), but never past twice the limit. Mirrors `debit` in src/limiter/algorithm.
local function fw_debit(key, now, limit, w, cost)
  local index = tg_index(now, w)
  local q = tg_shape('f', w)
  local i, c = fw_get(key, now, limit, w)
  local count = 0
  if i == index then
    count = c
  end
  local new = mmax(count, mmin(count + cost, 2 * limit))
  if i == index then
    -- Same window: the key already expires at its end.
    rcall('HSET', key, 'c', new)
    tg_remember_fields('fw', key, 3, index, new, q)
  else
    fw_put(key, index, new, w, q)
  end
end
