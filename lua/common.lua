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
