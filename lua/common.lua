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
-- evaluation made (one Redis command fewer per limit). Every write to a key forgets it, so a
-- key listed twice is read again, and spent twice, like the memory store.
local TG_SEEN = {}

local function tg_read_key(cmd, key, ...)
  local e = TG_SEEN[key]
  if e and e.cmd == cmd then
    return e.r, e.bad
  end
  local r, bad = tg_read(cmd, key, ...)
  TG_SEEN[key] = { cmd = cmd, r = r, bad = bad }
  return r, bad
end

local function tg_forget(key)
  TG_SEEN[key] = nil
end
