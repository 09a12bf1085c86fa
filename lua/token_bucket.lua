-- tollgate: token bucket (algorithm code 1) as GCRA (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, this file, leaky_bucket.lua,
-- fixed_window.lua, sliding_log.lua, sliding_window.lua and check.lua into one script. Only
-- check.lua reads KEYS/ARGV; this file defines the functions it dispatches to for code 1 (and,
-- through leaky_bucket.lua, code 2). Mirrors `bucket_eval` / `spend` / `refund` in
-- src/limiter/algorithm.rs line for line.
--
-- KEY   one STRING per limit: "<tat>:<interval>", the theoretical arrival time `tat` (integer
--       microseconds since the epoch; the bucket is full when tat <= now) and the interval it
--       was written under. Expires (SET PXAT) when it is full again. A key of another shape (a
--       reload changed the algorithm or the rate) is converted first: the units it still holds
--       are spent again at `now` under this rate (see tg_used in common.lua).
-- ARGV  (per key, passed by check.lua) limit = capacity, interval = microseconds per unit
--       (1 / rate), cost = units this request takes.
-- Reply (per key, in check.lua's reply) allowed (1/0), remaining (floored units),
--       reset_us (until full), retry_after_us (0 when allowed), delay_us (0 here).

-- The bucket state string of tat under interval t. The last one is kept: every cold bucket
-- of a batch (same rate and cost) gets the same tat.
local BP_TAT, BP_T, BP_V

local function bucket_state(tat, t)
  if tat ~= BP_TAT or t ~= BP_T then
    BP_TAT, BP_T, BP_V = tat, t, sfmt('%d:%d', tat, t)
  end
  return BP_V
end

-- Write (or, in peek, only remember) the bucket state tat under interval t.
local function bucket_put(key, tat, t)
  local v = bucket_state(tat, t)
  if TG_WRITE then
    rcall('SET', key, v, 'PXAT', tg_at_ms(tat))
  end
  tg_remember('bucket', key, v)
end

-- The stored tat under interval t, or nil when there is none; state of another shape is
-- converted first.
local function bucket_get(key, now, limit, t)
  local v, bad = tg_read_key('bucket', key, 'GET')
  if not v and not bad then
    return nil
  end
  local tat, iv
  if not bad then
    tat, iv = smatch(v, '^(%d+):(%d+)$')
  end
  if tonum(iv) == t then
    return tonum(tat)
  end
  local used = mmin(tg_used(key, now, limit * t), limit)
  if TG_WRITE then
    rcall('DEL', key)
  end
  tg_forget(key)
  if used <= 0 then
    if not TG_WRITE then
      tg_remember('bucket', key, false)
    end
    return nil
  end
  local seeded = now + used * t
  bucket_put(key, seeded, t)
  return seeded
end

-- Decide without writing. `leaky` reports the wait before forwarding as delay.
local function bucket_eval(key, now, limit, t, cost, leaky)
  local tat = bucket_get(key, now, limit, t)
  if not tat then
    tat = now
  end
  local cap = limit * t
  local base = mmax(tat, now)
  local new_tat = base + cost * t
  if new_tat - now <= cap then
    local delay = 0
    if leaky then
      delay = base - now
    end
    return true, floor((cap - (new_tat - now)) / t), new_tat - now, 0, delay
  end
  return false, floor(mmax(cap - (base - now), 0) / t), base - now,
    new_tat - cap - now, 0
end

local function tb_eval(key, now, limit, t, cost)
  return bucket_eval(key, now, limit, t, cost, false)
end

-- A request whose only limit is this bucket (no penalty, no lease; check.lua): bucket_eval,
-- then on admission what tb_spend would write, from the one read (tb_spend's own read would
-- find the state bucket_eval read, so the result is the same). Returns the allowed code (1 or
-- 0) and the reply's 4 numbers. `leaky` reports the wait before forwarding as delay.
local function bucket_check(key, now, limit, t, cost, leaky)
  if TG_NXGET and cost <= limit and TG_SEEN[key] == nil then
    -- A key this call has not read, and a cost a full bucket admits: write the state a full
    -- bucket would leave, only if the key does not exist, and read the old value in the same
    -- command (SET NX GET). A key that was absent (the common case of a client not seen since
    -- its bucket refilled) is then decided and written in one command; one that existed was
    -- left as it was, and its value is the read bucket_get makes below.
    local new_tat = now + cost * t
    local v = bucket_state(new_tat, t)
    local r, bad = tg_read('SET', key, v, 'NX', 'GET', 'PXAT', tg_at_ms(new_tat))
    if not r and not bad then
      tg_remember('bucket', key, v)
      return 1, limit - cost, cost * t, 0, 0
    end
    tg_note_read('bucket', key, r, bad)
  end
  local tat = bucket_get(key, now, limit, t)
  local base = now
  if tat and tat > now then
    base = tat
  end
  local cap = limit * t
  local new_tat = base + cost * t
  if new_tat - now <= cap then
    bucket_put(key, new_tat, t)
    local delay = 0
    if leaky then
      delay = base - now
    end
    return 1, floor((cap - (new_tat - now)) / t), new_tat - now, 0, delay
  end
  return 0, floor(mmax(cap - (base - now), 0) / t), base - now, new_tat - cap - now, 0
end

local function tb_check(key, now, limit, t, cost)
  return bucket_check(key, now, limit, t, cost, false)
end

-- Spend `cost` units: tat = max(tat, now) + cost * t; the key expires when the bucket is full.
local function tb_spend(key, now, limit, t, cost)
  local tat = bucket_get(key, now, limit, t)
  if not tat or tat < now then
    tat = now
  end
  bucket_put(key, tat + cost * t, t)
end

-- Give back `cost` units: tat -= cost * t (the expiry stays; it is then merely late). A key of
-- another shape (converted since the check) keeps its units.
local function tb_refund(key, now, limit, t, cost)
  local v = tg_read('GET', key)
  local tat, iv = smatch(v or '', '^(%d+):(%d+)$')
  if not tat or tonum(iv) ~= t then
    return
  end
  rcall('SET', key, sfmt('%d:%d', tonum(tat) - cost * t, t), 'KEEPTTL')
  tg_forget(key)
end

-- Debit `cost` more units at `now` (`cost_from`: a request's real cost came back after its
-- response), without checking: tat = max(tat, now) + cost * t, but never more than twice the
-- capacity ahead of now (the key is then denied for at most one full refill past empty); a tat
-- already further ahead stays. Mirrors `debit` in src/limiter/algorithm.
local function tb_debit(key, now, limit, t, cost)
  local tat = bucket_get(key, now, limit, t)
  local base = now
  if tat and tat > now then
    base = tat
  end
  local new = mmin(base + cost * t, now + 2 * limit * t)
  if tat and tat > new then
    new = tat
  end
  bucket_put(key, new, t)
end

-- A lease for the calling gateway (check.lua, flag 8), taken right after the request spent:
-- at most `want` units and half of what the request left, accounted as spent at the lease's
-- expiry, `life` us from now (a unit used then would have found the bucket refilled meanwhile):
-- tat = max(tat, now + life) + g * t, which must fit the capacity now. Refill is spent as
-- time, never rounded up to a whole unit. Returns g (no grant, nothing written, when g < 1).
local function tb_lease(key, now, limit, t, want, life)
  local tat = bucket_get(key, now, limit, t)
  if not tat or tat < now then
    tat = now
  end
  local cap = limit * t
  local r = floor((cap - (tat - now)) / t)
  local base = mmax(tat, now + life)
  local g = mmin(want, floor(r / 2), floor((cap - (base - now)) / t))
  if g >= 1 then
    bucket_put(key, base + g * t, t)
  end
  return g
end
