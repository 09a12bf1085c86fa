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

-- The library functions the script calls most, as upvalues (a global lookup costs a table
-- probe per use). A function library's top level may not read globals, so tg_begin fills
-- them on the first call.
local floor, mmax, mmin, sfmt, smatch, rcall, tonum

-- Bounds (mirrors of src/limiter/algorithm.rs): the gateway's validation keeps every rule
-- within them, and the script refuses any argument outside them (negative, fractional,
-- non-finite or huge), so a direct caller can neither mint quota nor stall Redis.
local TG_MAX_UNITS = 1000000000000       -- MAX_UNITS: limit, capacity, cost
local TG_MAX_SPAN = 316224000000000      -- MAX_SPAN_US: window, or capacity * interval (10 years)
local TG_MAX_LOG = 10000                 -- MAX_LOG_ENTRIES: sliding-log limit and cost
local TG_MAX_NOW = 4503599627370496      -- 2^52 us: year 2112

-- True when x is a whole number in [lo, hi] (false for nil, NaN and infinities).
local function tg_whole(x, lo, hi)
  return x ~= nil and x == x and x >= lo and x <= hi and x == floor(x)
end

-- ceil(a / b) for whole a >= 0, b > 0 below 2^53, exactly (a double division can round across
-- an integer).
local function tg_div_ceil(a, b)
  local q = floor(a / b)
  if q * b > a then
    q = q - 1
  end
  if q * b < a then
    q = q + 1
  end
  return q
end

-- Writes allowed in this call (check and refund); peek writes nothing, and converts state of
-- another shape only in its own view (TG_SEEN). Set per call by tg_begin.
local TG_WRITE

-- True when a write may read the old value in the same command, SET key value NX GET (Redis
-- 7.0 on; Redis 6 refuses NX with GET): check calls only. Set per call by tg_begin.
local TG_NXGET

-- Run a read command; a WRONGTYPE error reads as "no state" with `bad` set: the key holds a
-- limit of another algorithm (a reload changed it), which the readers convert. Any other error
-- (an ACL that refuses the command, say) is raised: read as "no state" it would admit.
local function tg_read(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'WRONGTYPE', 1, true) then
      return nil, true
    end
    error(r)
  end
  return r, false
end

-- Expiry: every key written gets, in the same script, an absolute expiry (PEXPIREAT / SET
-- PXAT, in milliseconds) at the instant its state becomes equivalent to no state, rounded up to
-- the next millisecond so a key never vanishes while it still matters. Absolute, in the
-- script's own time base: with `now` from Redis TIME this is exactly "PEXPIRE ttl rounded up";
-- with an explicit `now` (tests) expiry follows that clock, not the wall clock, so a test
-- driving time by hand sees the same states as one driven by Redis time.
--
-- As a decimal string, the form Redis reads: a number argument of redis.call is formatted with
-- "%.17g", which for these magnitudes takes glibc's multi-precision path; "%d" is exact for
-- every integer below 2^53 and several times cheaper.
-- The last instant asked for is kept: the writes of a call mostly share one (every cold bucket
-- of a batch gets tat = now + cost * interval, every window of a batch ends at one instant), and
-- string.format is a C call that makes a new string.
local TG_AT_US, TG_AT_S

local function tg_at_ms(us)
  if us ~= TG_AT_US then
    TG_AT_US, TG_AT_S = us, sfmt('%d', floor((us + 999) / 1000))
  end
  return TG_AT_S
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
-- Two parallel tables keyed by key name (no table per entry): the family that read it (its
-- "bad" form, TG_BAD[kind], when the read found a key of another type), and the read's result.
-- They outlive the call, so that a call's entries reuse the slots of the one before instead of
-- building and growing new tables each call: tg_begin clears the previous call's entries,
-- every one of which is under one of that call's KEYS (the only keys the algorithms read).
local TG_SEEN, TG_SEEN_R, TG_SEEN_KEYS
local TG_BAD = { bucket = 'bucket!', fw = 'fw!', sw = 'sw!' }

-- Record what `kind`'s read of `key` returned (tg_read's two results).
local function tg_note_read(kind, key, r, bad)
  if bad then
    TG_SEEN[key], TG_SEEN_R[key] = TG_BAD[kind], nil
  else
    TG_SEEN[key], TG_SEEN_R[key] = kind, r
  end
end

local function tg_read_key(kind, key, cmd, ...)
  local seen = TG_SEEN[key]
  if seen == kind then
    return TG_SEEN_R[key], false
  elseif seen ~= nil and seen == TG_BAD[kind] then
    return nil, true
  end
  local r, bad = tg_read(cmd, key, ...)
  tg_note_read(kind, key, r, bad)
  return r, bad
end

-- After a write: `r` is what `kind`'s read of `key` now returns (numbers where Redis would
-- return their decimal strings; readers convert with tonumber either way).
local function tg_remember(kind, key, r)
  TG_SEEN[key], TG_SEEN_R[key] = kind, r
end

-- After a write of a window hash: what `kind`'s read of `key` now returns is `n` fields (up
-- to 4, in its read's order), written into the table the last read or write of it left when
-- there is one (that table is referenced from nowhere else), else into a new one.
local function tg_remember_fields(kind, key, n, a, b, c, d)
  local r = TG_SEEN_R[key]
  if TG_SEEN[key] == kind and type(r) == 'table' then
    r[1], r[2], r[3] = a, b, c
    if n == 4 then
      r[4] = d
    end
  elseif n == 4 then
    TG_SEEN[key], TG_SEEN_R[key] = kind, { a, b, c, d }
  else
    TG_SEEN[key], TG_SEEN_R[key] = kind, { a, b, c }
  end
end

local function tg_forget(key)
  TG_SEEN[key] = nil
end

-- Calendar alignment of the limit being processed (check.lua sets it before every call of an
-- algorithm function; tg_used sets it from a stored shape): unit 0 = none (epoch-aligned
-- windows of length w), 1 day, 2 week (from Monday), 3 month; offset in seconds east of UTC.
local TG_CAL_UNIT, TG_CAL_OFF = 0, 0
local TG_DAY = 86400000000

local function tg_cal(unit, off)
  TG_CAL_UNIT, TG_CAL_OFF = unit or 0, off or 0
end

-- Days since 1970-01-01 of a civil date, and back (H. Hinnant's algorithms; dates after 1970,
-- so every value is non-negative and floor division is exact). Mirror
-- src/limiter/algorithm/calendar.rs.
local function tg_days_from_civil(y, m, d)
  if m <= 2 then
    y = y - 1
  end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mm = m + 9
  if m > 2 then
    mm = m - 3
  end
  local doy = floor((153 * mm + 2) / 5) + d - 1
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function tg_civil_from_days(z)
  z = z + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp - 9
  if mp < 10 then
    m = mp + 3
  end
  local y = yoe + era * 400
  if m <= 2 then
    y = y + 1
  end
  return y, m
end

-- The index of the window (length w, or the calendar unit) holding instant t.
local function tg_index(t, w)
  if TG_CAL_UNIT == 0 then
    return floor(t / w)
  end
  local l = t + TG_CAL_OFF * 1000000
  if TG_CAL_UNIT == 1 then
    return floor(l / TG_DAY)
  elseif TG_CAL_UNIT == 2 then
    return floor((l + 3 * TG_DAY) / (7 * TG_DAY))
  end
  local y, m = tg_civil_from_days(floor(l / TG_DAY))
  return y * 12 + m - 1
end

-- The instant window `index` starts (window index + 1 starts where it ends).
local function tg_start(index, w)
  if TG_CAL_UNIT == 0 then
    return index * w
  end
  local l
  if TG_CAL_UNIT == 1 then
    l = index * TG_DAY
  elseif TG_CAL_UNIT == 2 then
    l = index * 7 * TG_DAY - 3 * TG_DAY
  else
    l = tg_days_from_civil(floor(index / 12), index % 12 + 1, 1) * TG_DAY
  end
  return l - TG_CAL_OFF * 1000000
end

-- The shape string of a hash-kept limit, "<family>:<window>" (f: fixed, s: sliding window),
-- plus ":c<unit>:<offset>" for a calendar window; memoised for the plain ones (every request of
-- a batch asks for the same few).
local TG_SHAPES

-- Entries added to the memo tables (TG_SHAPES, TG_NUM, TG_UINT, TG_DEC, TG_SPEC) since they were last emptied.
local TG_MEMO_N = 0

local function tg_shape(fam, w)
  if TG_CAL_UNIT ~= 0 then
    return fam .. ':' .. sfmt('%d', w) .. ':c' .. TG_CAL_UNIT .. ':' .. sfmt('%d', TG_CAL_OFF)
  end
  local v = TG_SHAPES[fam][w]
  if v == nil then
    v = fam .. ':' .. sfmt('%d', w)
    TG_SHAPES[fam][w] = v
    TG_MEMO_N = TG_MEMO_N + 1
  end
  return v
end

-- Units the state at `key` still holds at `now`, whatever algorithm or window wrote it, rounded
-- up (conservative): the consumption a reload carries over to a limit of another shape, counted
-- for that limit's `span` (its window, or a bucket's capacity * interval) where the old state
-- keeps timestamps (a sliding log). Mirrors `used` in src/limiter/algorithm.rs.
local function tg_used(key, now, span)
  local t = rcall('TYPE', key)['ok']
  if t == 'string' then
    local tat, iv = smatch(rcall('GET', key) or '', '^(%d+):(%d+)$')
    tat, iv = tonum(tat), tonum(iv)
    if not tat or not iv or iv <= 0 or tat <= now then
      return 0
    end
    return tg_div_ceil(tat - now, iv)
  elseif t == 'hash' then
    local r = rcall('HMGET', key, 'i', 'p', 'c', 'q')
    local q = r[4] or ''
    local fam, w = smatch(q, '^(%a):(%d+)')
    local cu, co = smatch(q, ':c(%d):(%-?%d+)$')
    w = tonum(w)
    local i = tonum(r[1])
    if not w or w <= 0 or not i then
      return 0
    end
    -- Read the stored state under ITS calendar, then restore the current limit's.
    local su, so = TG_CAL_UNIT, TG_CAL_OFF
    tg_cal(tonum(cu) or 0, tonum(co) or 0)
    local index = tg_index(now, w)
    local start, len = tg_start(index, w), tg_start(index + 1, w) - tg_start(index, w)
    tg_cal(su, so)
    if fam == 'f' then
      if i == index then
        return tonum(r[3]) or 0
      end
      return 0
    elseif fam == 's' then
      local prev, curr = 0, 0
      if i == index then
        prev, curr = tonum(r[2]) or 0, tonum(r[3]) or 0
      elseif i + 1 == index then
        prev = tonum(r[3]) or 0
      end
      local elapsed = now - start
      return mmax(math.ceil(prev * (len - elapsed) / len + curr), 0)
    end
    return 0
  elseif t == 'zset' then
    return rcall('ZCOUNT', key, sfmt('(%d', mmax(now - span, 0)), '+inf')
  end
  return 0
end

-- tonumber, memoised by string: a batch repeats the same few limit arguments ("1000000" ...)
-- for every request, and Lua's string-to-number conversion (strtod) is one of the costliest
-- steps of a script run. Lua interns strings, so the lookup is one hash probe.
local TG_NUM, TG_UINT
-- A limit's spec string to its validated record or false (limit_spec in check.lua).
local TG_SPEC

-- A whole number in [0, 2^53] (the bounds of every count, limit and instant), memoised like
-- tg_num, or nil for anything else (negative, fractional, non-finite, not a number): the
-- check every limit argument starts with, so that what remains is a comparison per bound.
local function tg_uint(s)
  local v = TG_UINT[s]
  if v == nil then
    if s == nil then
      return nil
    end
    v = tonum(s)
    if v == nil or v ~= v or v < 0 or v > 9007199254740992 or v ~= floor(v) then
      v = false
    end
    TG_UINT[s] = v
    TG_MEMO_N = TG_MEMO_N + 1
  end
  return v or nil
end

-- The decimal string of a whole number (a count, a cost, a window index), memoised like the
-- argument memos: a batch writes the same few (a cost of 1, the current window's index).
local TG_DEC

local function tg_dec(n)
  local v = TG_DEC[n]
  if v == nil then
    v = sfmt('%d', n)
    if n == n then
      TG_DEC[n] = v
      TG_MEMO_N = TG_MEMO_N + 1
    end
  end
  return v
end

local function tg_num(s)
  if s == nil then
    return nil
  end
  local v = TG_NUM[s]
  if v == nil then
    v = tonum(s)
    if v ~= nil then
      TG_NUM[s] = v
      TG_MEMO_N = TG_MEMO_N + 1
    end
  end
  return v
end

-- The start of every call: the per-call state above, afresh. The memo tables map an argument
-- string to what it always means, so they outlive the call (the same few strings come in every
-- call; building them afresh was a tenth of a one-request call), but they are emptied once they
-- hold 4096 entries: whatever callers send, they stay small.
local function tg_begin(mode, keys)
  if not rcall then
    floor, mmax, mmin, sfmt, smatch = math.floor, math.max, math.min, string.format, string.match
    rcall, tonum = redis.call, tonumber
  end
  TG_WRITE = mode ~= 'peek'
  TG_NXGET = mode == 'check' and (redis.REDIS_VERSION_NUM or 0) >= 0x070000
  if TG_SEEN == nil then
    TG_SEEN, TG_SEEN_R = {}, {}
  elseif TG_SEEN_KEYS then
    local seen, seen_r = TG_SEEN, TG_SEEN_R
    for i = 1, #TG_SEEN_KEYS do
      local k = TG_SEEN_KEYS[i]
      seen[k], seen_r[k] = nil, nil
    end
  end
  TG_SEEN_KEYS = keys
  if TG_NUM == nil or TG_MEMO_N > 4096 then
    -- TG_UINT starts with "0", the deadline of a request that has none (run_check reads
    -- deadlines from the memo only: they are mostly new with every request).
    TG_NUM, TG_UINT, TG_SHAPES, TG_DEC, TG_SPEC, TG_MEMO_N = {}, { ['0'] = 0 }, { f = {}, s = {} }, {}, {}, 0
  end
  TG_CAL_UNIT, TG_CAL_OFF = 0, 0
end
