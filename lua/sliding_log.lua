-- tollgate: sliding log (algorithm code 4) (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, token_bucket.lua,
-- leaky_bucket.lua, fixed_window.lua, this file, sliding_window.lua and check.lua into one
-- script; check.lua dispatches code 4 to the functions below. Mirrors `log_eval` / `spend` in
-- src/limiter/algorithm.rs: admit if (units admitted in (now - window, now]) + cost <= limit.
--
-- KEY   one ZSET per limit, one member per admitted unit, score = admission time (integer
--       microseconds). Members are "<now>:<seq>" with seq zero-padded to 12 digits and one
--       more than the largest seq already stored at that score, so members stay unique even
--       for several requests in the same microsecond and across refunds. Entries at or before
--       now - window are removed whenever a check evaluates the key. Expires (PEXPIREAT) one window
--       after the newest entry. A log needs no shape: its timestamps hold under any window. A key
--       of another type (a reload changed the algorithm) is converted first: the units it still
--       holds become entries at `now` (tg_used). At most TG_MAX_LOG entries per key.
-- ARGV  (per key, passed by check.lua) limit = units per window, interval = window in
--       microseconds, cost = units this request takes.
-- Reply (per key) allowed (1/0), remaining, reset_us (until the oldest entry leaves),
--       retry_after_us (until enough entries left for this request; 0 when allowed),
--       delay_us (0).

-- Entries at or before this instant have left the window.
local function sl_floor(now, w)
  local f = now - w
  if f < 0 then
    f = 0
  end
  return f
end

-- Score of the (n+1)-th entry inside the window (n from 0), oldest first.
local function sl_nth(key, lo, n)
  local r = rcall('ZRANGEBYSCORE', key, lo, '+inf', 'WITHSCORES', 'LIMIT', n, 1)
  return tonum(r[2])
end

-- Add `n` entries at `now` (members "<now>:<seq>", seq from `seq`), in chunks.
local function sl_add(key, now, seq, n)
  local prefix = sfmt('%d:', now)
  local args = {}
  for j = 0, n - 1 do
    args[#args + 1] = now
    args[#args + 1] = prefix .. sfmt('%012d', seq + j)
    if #args >= 2000 then
      rcall('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then
    rcall('ZADD', key, unpack(args))
  end
end

local function sl_eval(key, now, limit, w, cost)
  local lo = sfmt('(%d', sl_floor(now, w))
  if TG_WRITE then
    -- Entries that left the window go whenever a check evaluates the key, admitted or not (the
    -- memory store prunes at the same point, so both hold the same entries for a later reload
    -- to read).
    tg_read('ZREMRANGEBYSCORE', key, '-inf', sl_floor(now, w))
  end
  local count, bad = tg_read('ZCOUNT', key, lo, '+inf')
  if bad then
    -- Another algorithm's state: carry its units over as entries at now.
    local used = mmin(tg_used(key, now, w), limit)
    if not TG_WRITE then
      if used + cost <= limit then
        return true, limit - used - cost, w, 0, 0
      end
      return false, mmax(limit - used, 0), w, w, 0
    end
    rcall('DEL', key)
    if used > 0 then
      sl_add(key, now, 0, used)
      rcall('PEXPIREAT', key, tg_at_ms(now + w))
    end
    count = used
  end
  count = count or 0
  local oldest = now
  if count > 0 then
    oldest = sl_nth(key, lo, 0) or now
  end
  if count + cost <= limit then
    return true, limit - count - cost, oldest + w - now, 0, 0
  end
  -- The (count + cost - limit)-th oldest entry must leave the window first.
  local k = count + cost - limit
  local tk = now
  if k <= count then
    tk = sl_nth(key, lo, k - 1) or now
  end
  return false, mmax(limit - count, 0), oldest + w - now, tk + w - now, 0
end

local function sl_spend(key, now, limit, w, cost)
  -- sl_eval, at this `now`, pruned the key (and converted one of another type).
  if cost > 0 then
    local seq = 0
    local top = rcall('ZREVRANGEBYSCORE', key, now, now, 'LIMIT', 0, 1)
    if top[1] then
      local s = smatch(top[1], ':(%d+)$')
      if s then
        seq = tonum(s) + 1
      end
    end
    sl_add(key, now, seq, cost)
  end
  rcall('PEXPIREAT', key, tg_at_ms(now + w))
end

-- A request whose only limit is this log (no penalty, no lease; check.lua): sl_eval, then on
-- admission what sl_spend writes. When the window held nothing (remaining = limit - cost),
-- sl_eval's pruning left no entry at `now` either, so the entries start at sequence 0 without
-- sl_spend's lookup of the newest one. Returns the allowed code (1 or 0) and the reply's 4
-- numbers.
local function sl_check(key, now, limit, w, cost)
  local ok, remaining, reset, retry = sl_eval(key, now, limit, w, cost)
  if not ok then
    return 0, remaining, reset, retry, 0
  end
  if remaining == limit - cost then
    if cost > 0 then
      sl_add(key, now, 0, cost)
    end
    rcall('PEXPIREAT', key, tg_at_ms(now + w))
  else
    sl_spend(key, now, limit, w, cost)
  end
  return 1, remaining, reset, 0, 0
end

-- Give back `cost` units: remove the `cost` newest entries at or before `now`. With the `now`
-- the check used (a cross-slot rejection), those are exactly the entries it added (or, with
-- several requests in that microsecond, equivalent ones). With a later `now` (a leaky-bucket
-- client that left), the newest ones are removed, like the memory store does.
local function sl_refund(key, now, limit, w, cost)
  local r = tg_read('ZREVRANGEBYSCORE', key, now, '-inf', 'LIMIT', 0, cost)
  if r and #r > 0 then
    rcall('ZREM', key, unpack(r))
  end
end
