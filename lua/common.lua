-- tollgate: shared helpers (fragment 1 of the combined limit script).
--
-- This file is NOT a script on its own. src/limiter/redis.rs concatenates
--   common.lua, token_bucket.lua, leaky_bucket.lua, fixed_window.lua,
--   sliding_log.lua, sliding_window.lua, check.lua
-- into ONE script, loaded once and run with EVALSHA, so that one call checks every limit of a
-- request that lives on one Redis Cluster slot, whatever their algorithms. Every fragment only
-- defines `local` functions; check.lua is the entry point that reads KEYS and ARGV.
--
-- Numbers: Lua numbers are doubles. Every integer tollgate handles (microsecond timestamps,
-- limits, counts, `limit * interval`) is below 2^53, so integer arithmetic on them is exact and
-- `math.floor(a / b)` equals Rust's integer `a / b`. Redis converts a number argument of
-- redis.call with "%.17g" (exact for these integers) and a number in a reply by truncation.
-- `tostring` is NOT exact ("%.14g"): build strings from numbers with string.format('%d', x).

-- Run a read command; a WRONGTYPE (or any) error reads as "no state". This happens only when a
-- rule changed algorithm on reload while keeping its name and window, so the old counter has
-- another Redis type; the limit then starts afresh and the next spend replaces the key.
local function tg_read(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    return nil, true
  end
  return r, false
end

-- Expiry: every key written gets, in the same script, an absolute expiry (PEXPIREAT / SET
-- PXAT, in milliseconds) at the instant its state becomes equivalent to no state, rounded up to
-- the next millisecond so a key never vanishes while it still matters. Absolute, in the
-- script's own time base: with `now` from Redis TIME this is exactly "PEXPIRE ttl rounded up";
-- with an explicit `now` (tests) expiry follows that clock, not the wall clock, so a test
-- driving time by hand sees the same states as one driven by Redis time.
local function tg_at_ms(us)
  return math.floor((us + 999) / 1000)
end

-- An integer Redis can return: a non-finite or huge double (only reachable with cost > limit,
-- which validation refuses) is clamped to 2^53.
local function tg_int(x)
  if x ~= x or x > 9007199254740992 then
    return 9007199254740992
  end
  return x
end

-- Reads of one key within this script call, so that spending a key reuses the read its
-- evaluation made, and the next request of a batch (check.lua) reuses what the previous one
-- wrote: one Redis command fewer per limit, two per limit for a batched request on a hot key.
-- An entry is tagged with the algorithm family that read it (`kind`: the same command returns
-- another shape for another algorithm, e.g. HMGET i c vs HMGET i p c), and every write either
-- replaces the entry with exactly what a fresh read would now return (tg_remember) or drops it
-- (tg_forget).
local TG_SEEN = {}

local function tg_read_key(kind, key, cmd, ...)
  local e = TG_SEEN[key]
  if e and e.kind == kind then
    return e.r, e.bad
  end
  local r, bad = tg_read(cmd, key, ...)
  TG_SEEN[key] = { kind = kind, r = r, bad = bad }
  return r, bad
end

-- After a write: `r` is what `kind`'s read of `key` now returns (numbers where Redis would
-- return their decimal strings; readers convert with tonumber either way).
local function tg_remember(kind, key, r)
  TG_SEEN[key] = { kind = kind, r = r, bad = false }
end

local function tg_forget(key)
  TG_SEEN[key] = nil
end

-- tonumber, memoised by string: a batch repeats the same few limit arguments ("1000000" ...)
-- for every request, and Lua's string-to-number conversion (strtod) is one of the costliest
-- steps of a script run. Lua interns strings, so the lookup is one hash probe.
local TG_NUM = {}

local function tg_num(s)
  if s == nil then
    return nil
  end
  local v = TG_NUM[s]
  if v == nil then
    v = tonumber(s)
    if v ~= nil then
      TG_NUM[s] = v
    end
  end
  return v
end
