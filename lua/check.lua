-- tollgate: entry point of the combined limit script (its last fragment).
--
-- src/limiter/redis.rs concatenates common.lua, token_bucket.lua, leaky_bucket.lua,
-- fixed_window.lua, sliding_log.lua, sliding_window.lua and this file into ONE script, run
-- with EVALSHA (EVAL on NOSCRIPT). One call checks every limit of a request that lives on one
-- Redis Cluster slot, whatever their algorithms; limits on other slots get their own call.
--
-- KEYS  the limit keys, all sharing one {hash tag} (one slot), each followed by its penalty key
--       when its limit has a penalty box (flag 2), then by its RESET MARKER key ("<key>:r") in
--       refund mode, and in check mode when it asks for a lease (flag 8). May be empty (probe).
--       In reset mode: the marker keys only.
-- ARGV[1]  mode: "check" | "refund" | "peek"
-- ARGV[2]  now in microseconds since the epoch, or "" to read Redis TIME (the normal case:
--          every gateway then agrees on time; tests pass an explicit now)
-- A limit is described by its SPEC, one ARGV "code:limit:interval_us:cost:flags" (decimal
--   digits only): algorithm code (1 token_bucket, 2 leaky_bucket, 3 fixed_window,
--   4 sliding_log, 5 sliding_window, 6 concurrency), limit, interval_us (buckets: microseconds
--   per unit; windows: the window; concurrency: the slot time to live), cost, flags (1 = shadow:
--   never blocks the request; 2 = penalty box); a gateway's batches repeat a few specs, which
--   the script validates once (limit_spec). Then, as ARGV of their own:
--   - for concurrency, 1 more: the holder of the slot (letters, digits, ':', at most 64 bytes);
--   - with flag 2, 2 more: the penalty's base and max in microseconds;
--   - with flag 4 (fixed and sliding window only), 2 more: the calendar unit (1 day, 2 week
--     from Monday, 3 month) and the UTC offset in seconds (-64800 .. 64800): windows are then
--     the clock's days, weeks or months (tg_index / tg_start in common.lua);
--   - with flag 8 (token bucket, fixed and sliding window only; check mode), 2 more: a LEASE
--     for the calling gateway: `want` units (1 .. 10^12) and `life` (0 .. 10 years in us, the
--     lease's life; 0 for windows). When the request is admitted and spent, the script grants
--     g = min(want, floor(r / 2)) units, r being what remains after the request, and spends
--     them at once; a token bucket's lease counts as spent at its expiry: tat becomes
--     max(tat, now + life) + g * interval, and g is also capped so that this fits the capacity
--     now (tb_lease; see src/limiter/lease.rs). The reply's allowed code is then 5 and its delay
--     slot carries g. No grant when g < 1.
-- Reset marker ("<key>:r", a string "<at_us>:<leases_from_us>": the Redis instant of the key's
--   last reset, and when leases of it may be granted again; written by reset mode, see
--   src/limiter/redis.rs, reset_settled). Until leases_from a check grants no lease of the
--   key; while the marker lives (long after: requests in flight at the reset settle late), a
--   refund whose now (the instant its units were spent) is at or before at gives nothing
--   back: those units belong to the count the reset deletes, and neither a lease return nor
--   a settlement may mint them into the new one. A marker of the older form ("<at_us>")
--   blocks leases for its whole life. Concurrency releases are never dropped (slots survive
--   a reset).
-- Penalty box (flag 2): a string at the penalty key, "<until_us>:<len_us>", expiring at until.
--   While until > now the limit denies without being evaluated (allowed code 3) and, when
--   max > base, each such request doubles the penalty from now (len = min(2 len, max)). A
--   denial outside a penalty starts one of `base` (allowed code 4). Penalties are written even
--   when the request is blocked (that is their point); nothing else is.
--
-- check: a BATCH of requests, evaluated one after the other exactly as if each had been its
--   own call (the gateway batches the requests that are waiting for the same slot, so a busy
--   slot costs one round trip and one script run for many requests):
--   ARGV[3] = R, the number of requests; then per request: n (its limit count), its DEADLINE
--   (microseconds of Redis time, 0 for none), followed by each limit's ARGV. KEYS holds every
--   request's keys, request after request.
--   A request whose deadline is before now (its gateway has given up on it: the call waited
--   in a frozen or overloaded server) is not evaluated and writes nothing, penalties included;
--   each of its limits answers allowed code 6 ("late"), which the gateway treats as a timeout.
--   Per request: every key is evaluated; the request is blocked when a non-shadow key denies.
--   When not blocked, every admitted key is spent (a denied shadow key spends nothing) and
--   gets its expiry; when blocked, nothing is written at all (rejected requests are never
--   counted). A later request in the batch sees what the earlier ones spent.
-- peek, refund and renew: the limits one after the other, in KEYS order.
--
-- Reply, every mode: the numbers
--   { now, allowed_1, remaining_1, reset_us_1, retry_after_us_1, delay_us_1, allowed_2, ... }
--   with one 5-tuple per key, in KEYS order (for check: request after request; refund: none),
--   PACKED: one binary string of little-endian IEEE doubles, 8 bytes per number (exact: every
--   value is an integer in 0 .. 2^53). A client then parses one bulk string instead of 1 + 5 n
--   integers, which for the gateway's Redis client was the costliest part of a batched request.
--   allowed is 1 or 0; 2 in a peek where the key does not exist; 3 when the key is in its penalty
--   box (retry_after_us = the time left); 4 when this denial started or escalated a penalty
--   (retry_after_us at least the penalty); 5 when admitted with a lease (delay slot = units); 6
--   when its request came after its deadline (check only; nothing spent). One 5-tuple per
--   LIMIT (a penalty or marker key adds none).
-- peek: as a cost-0 check with cost forced to 0, writing nothing (state of another shape is
--   converted in the reply only).
-- Every limit argument is checked before anything runs: whole numbers, limit 1..10^12,
--   interval 1..10 years in us (buckets: limit * interval too), cost 0..10^12, sliding log
--   limit and cost at most 10,000, shadow 0 or 1, now below 2^52. Anything else (negative,
--   fractional, non-finite, huge) is an error reply and changes nothing.
-- refund: ARGV[2] must be the `now` the check used (or "" for Redis time); gives back `cost`
--   on every key (see each algorithm's *_refund; a concurrency slot is released). Reply:
--   { now }, packed.
-- renew: pushes each concurrency slot still held out to now + time to live. Reply: { now }.
-- reset: ARGV = reset, "", life_ms, lease_ms; sets every key of KEYS (marker keys) to
--   "<now>:<now + lease_ms>" (Redis TIME), expiring in life_ms. Reply: { now }.
-- debit: ARGV[2] = now ("" for Redis TIME: the instant the real cost is known, not the check's);
--   spends `cost` more on every key at now without checking (a bucket's tat moves on from
--   max(tat, now); a window's count grows in now's window, the check's while it lasts), so a
--   request's real cost, known after its response, may take a key below zero, but never more
--   than one quota below (see each algorithm's *_debit). Reply: { now }.

-- debit: the extra units of a request whose real cost came after its response (`cost_from`);
-- sliding log and leaky bucket take no debits (validation refuses cost_from on them).
-- check: eval, then spend on admission, from one read, for a request whose only limit this is
-- (run_check; concurrency goes the general way).
local ALGOS = {
  { eval = tb_eval, spend = tb_spend, refund = tb_refund, debit = tb_debit, check = tb_check },
  { eval = lb_eval, spend = lb_spend, refund = lb_refund, check = lb_check },
  { eval = fw_eval, spend = fw_spend, refund = fw_refund, debit = fw_debit, check = fw_check },
  { eval = sl_eval, spend = sl_spend, refund = sl_refund, check = sl_check },
  { eval = sw_eval, spend = sw_spend, refund = sw_refund, debit = sw_debit, check = sw_check },
  { eval = cc_eval, spend = cc_take, refund = cc_release, renew = cc_renew },
}

-- Per-call state. The helpers below are defined once, when the library loads (a function
-- library) or once per run (EVAL); every call starts afresh in tg_run, which sets all of it.
local KEYS, ARGV, mode, now
-- The parsed limits: limit i has ALGO[i], LIMIT[i], ... (parsed once, used by evaluation and
-- spending); its key is KEYS[KEY[i]] and its penalty key KEYS[PKEY[i]] (nil without one).
local ALGO, LIMIT, INTERVAL, COST, SHADOW, MEMBER, KEY, PKEY, PBASE, PMAX
-- The reset marker key of limit i: KEYS[MKEY[i]] (nil when not sent, see KEYS above).
local MKEY
-- Calendar alignment of limit i (unit 0 = none; see tg_cal in common.lua).
local CALU, CALO
-- Lease wanted by limit i and its life in us (nil without flag 8).
local LWANT, LLIFE
local nlimits, nkeys
local reply
-- check's per-request and per-limit bookkeeping (run_check): request r owns limits FIRST[r] + 1
-- .. FIRST[r] + COUNT[r] and has DEADLINE[r]; PLAIN[r] when it goes the one-read way (its one
-- limit was parsed lean); limit i was ADMITTED[i], and its 5-tuple starts at reply[ROFF[i] + 1].
-- Written before they are read, in every call.
local FIRST, COUNT, DEADLINE, PLAIN, ADMITTED, ROFF
-- The spec record (limit_spec) of a limit parsed lean: SPEC[i] (only such limits have one).
local SPEC

-- Limit i's reset marker: the instant of its last reset and when leases may be granted again
-- (nil, nil without one; the older form "<at>" blocks leases while it lives).
local function reset_marker(i)
  local v = rcall('GET', KEYS[MKEY[i]])
  if not v then
    return nil, nil
  end
  local a, u = smatch(v, '^(%d+):(%d+)$')
  if a then
    return tonum(a), tonum(u)
  end
  return tonum(v), math.huge
end

-- True when limit i may take a lease now: no reset is settling on it.
local function leases_open(i)
  local _, from = reset_marker(i)
  return from == nil or now >= from
end

-- A limit's spec, "code:limit:interval:cost:flags" (decimal digits), as a record
-- { algorithm, limit, interval, cost, shadow, flags, code }, or false unless every number is
-- within the bounds (common.lua) and the flags are known: validated once per distinct spec and
-- memoised like the other arguments (a batch repeats the few specs of the gateway's rules, so
-- an argument seen before costs one table probe).
local function limit_spec(s)
  local v = TG_SPEC[s]
  if v ~= nil or s == nil then
    return v or false
  end
  v = false
  local c, l, t, n, f = smatch(s, '^(%d+):(%d+):(%d+):(%d+):(%d+)$')
  local code, limit, interval, cost, flags
  if c then
    code, limit, interval, cost, flags = tonum(c), tonum(l), tonum(t), tonum(n), tonum(f)
  end
  if code and code >= 1 and code <= 6 and limit >= 1 and limit <= TG_MAX_UNITS
    and interval >= 1 and interval <= TG_MAX_SPAN and cost <= TG_MAX_UNITS and flags <= 15
    and not ((code == 1 or code == 2) and limit * interval > TG_MAX_SPAN)
    and not (code == 4 and (limit > TG_MAX_LOG or cost > TG_MAX_LOG))
    and not (code == 6 and cost > 1) then
    v = { ALGOS[code], limit, interval, cost, flags % 2 == 1, flags, code }
  end
  TG_SPEC[s] = v
  TG_MEMO_N = TG_MEMO_N + 1
  return v
end

-- Parse the limit whose arguments start after ARGV[b] (its spec, then the extras its flags
-- ask for); returns the index after its last argument, or nil unless the spec is valid
-- (limit_spec) and the extras within their bounds and the holder well formed. With `lean` (a
-- check request of this one limit), a plain limit (no flag; an algorithm with a `check`) gets
-- only SPEC, SHADOW and KEY written, and true as a second result: run_check then takes it the
-- one-read way, which reads nothing else of it.
local function parse_limit(b, lean)
  local s = TG_SPEC[ARGV[b + 1]] or limit_spec(ARGV[b + 1])
  if not s then
    return nil
  end
  local i, k = nlimits + 1, nkeys + 1
  if lean and s[6] == 0 and s[1].check then
    SPEC[i], SHADOW[i], KEY[i] = s, s[5], k
    nlimits, nkeys = i, k
    return b + 1, true
  end
  local code, flags = s[7], s[6]
  ALGO[i], LIMIT[i], INTERVAL[i], COST[i], SHADOW[i], KEY[i] = s[1], s[2], s[3], s[4], s[5], k
  -- The tables outlive the call (tg_run): every field of limit i is written here, the optional
  -- ones cleared first, so nothing of an earlier call's limit i is ever read.
  MEMBER[i], PKEY[i], PBASE[i], PMAX[i], MKEY[i], LWANT[i], LLIFE[i] = nil, nil, nil, nil, nil, nil, nil
  b = b + 1
  if code == 6 then
    local m = ARGV[b + 1]
    if m == nil or #m > 64 or not smatch(m, '^[%w:]+$') then
      return nil
    end
    MEMBER[i] = m
    b = b + 1
  end
  if flags % 4 >= 2 then
    local base, max = tg_num(ARGV[b + 1]), tg_num(ARGV[b + 2])
    if not tg_whole(base, 1, TG_MAX_SPAN) or not tg_whole(max, base, TG_MAX_SPAN) then
      return nil
    end
    k = k + 1
    PKEY[i], PBASE[i], PMAX[i] = k, base, max
    b = b + 2
  end
  if mode == 'refund' or (mode == 'check' and flags >= 8) then
    k = k + 1
    MKEY[i] = k
  end
  CALU[i], CALO[i] = 0, 0
  if flags % 8 >= 4 then
    local unit, off = tg_num(ARGV[b + 1]), tg_num(ARGV[b + 2])
    if (code ~= 3 and code ~= 5) or not tg_whole(unit, 1, 3) or not tg_whole(off, -64800, 64800) then
      return nil
    end
    CALU[i], CALO[i] = unit, off
    b = b + 2
  end
  if flags >= 8 then
    local want, life = tg_num(ARGV[b + 1]), tg_num(ARGV[b + 2])
    if (code ~= 1 and code ~= 3 and code ~= 5) or not tg_whole(want, 1, TG_MAX_UNITS)
      or not tg_whole(life, 0, TG_MAX_SPAN) then
      return nil
    end
    LWANT[i], LLIFE[i] = want, life
    b = b + 2
  end
  nlimits, nkeys = i, k
  return b
end

-- The penalty limit i is serving at `now`: time left and its length, or nil.
local function penalty_of(i)
  if not PKEY[i] then
    return nil
  end
  local v = rcall('GET', KEYS[PKEY[i]])
  local untl, len = smatch(v or '', '^(%d+):(%d+)$')
  untl, len = tonum(untl), tonum(len)
  if untl and len and untl > now then
    return untl - now, len
  end
  return nil
end

-- Put limit i in its penalty box for `len` from now.
local function penalize(i, len)
  local untl = now + len
  rcall('SET', KEYS[PKEY[i]], sfmt('%d:%d', untl, len), 'PXAT', tg_at_ms(untl))
end

-- The struct.pack format of n little-endian doubles, kept per n: n is at most 1000, so this
-- holds at most 1000 strings (about 500 KB if every length came; a gateway's replies have a
-- handful of lengths).
local PACK_FMT = {}

local function pack_fmt(n)
  local f = PACK_FMT[n]
  if f == nil then
    f = '<' .. string.rep('d', n)
    PACK_FMT[n] = f
  end
  return f
end

-- The reply, packed: values[1 .. n] as one string of little-endian doubles, in chunks of 1000
-- (unpack() puts every value on the Lua stack, which holds about 8000); one chunk is returned
-- as it is.
local function pack(values, n)
  if n <= 1000 then
    return struct.pack(pack_fmt(n), unpack(values, 1, n))
  end
  local parts = {}
  for i = 1, n, 1000 do
    local j = mmin(i + 999, n)
    parts[#parts + 1] = struct.pack(pack_fmt(j - i + 1), unpack(values, i, j))
  end
  return table.concat(parts)
end

-- Evaluate limit i (cost `cost`) with its penalty box: allowed code, remaining, reset, retry,
-- delay. In a check (`write`), a denial starts a penalty and a request during one escalates it.
local function decide(i, cost, write)
  local left, len = penalty_of(i)
  if left then
    if write and PMAX[i] > PBASE[i] then
      local longer = mmin(mmax(2 * len, PBASE[i]), PMAX[i])
      penalize(i, longer)
      return 4, 0, longer, longer, 0
    end
    return 3, 0, left, left, 0
  end
  tg_cal(CALU[i], CALO[i])
  local ok, remaining, reset, retry, delay = ALGO[i].eval(KEYS[KEY[i]], now, LIMIT[i], INTERVAL[i], cost)
  if ok then
    return 1, remaining, reset, retry, delay
  end
  if write and PKEY[i] then
    penalize(i, PBASE[i])
    return 4, remaining, mmax(reset, PBASE[i]), mmax(retry, PBASE[i]), delay
  end
  return 0, remaining, reset, retry, delay
end

-- check: the batch (see the header).
local function run_check()
  local argc = #ARGV
  local requests = tonum(ARGV[3])
  if requests == nil then
    return redis.error_reply('ERR tollgate: bad arguments (want a request count)')
  end
  -- Parse and validate the whole batch before anything is written; request r owns limits
  -- FIRST[r] + 1 .. FIRST[r] + COUNT[r].
  local b = 3
  for r = 1, requests do
    local m = TG_UINT[ARGV[b + 1]] or tg_uint(ARGV[b + 1])
    -- A deadline is mostly new with every request: read, not memoised (an entry per request
    -- would only fill the memo), unless it is one the memo holds ("0", none).
    local dl = TG_UINT[ARGV[b + 2]]
    if not dl then
      dl = tonum(ARGV[b + 2])
      if not tg_whole(dl, 0, TG_MAX_NOW) then
        dl = nil
      end
    end
    if m == nil or dl == nil or b + 2 + m > argc or dl > TG_MAX_NOW then
      return redis.error_reply('ERR tollgate: bad arguments (request layout)')
    end
    FIRST[r], COUNT[r], DEADLINE[r] = nlimits, m, dl
    b = b + 2
    local plain = false
    for _ = 1, m do
      b, plain = parse_limit(b, m == 1)
      if b == nil then
        return redis.error_reply('ERR tollgate: bad arguments for limit ' .. (nlimits + 1))
      end
    end
    PLAIN[r] = plain == true
  end
  if b ~= argc or nkeys ~= #KEYS then
    return redis.error_reply('ERR tollgate: bad arguments (want R, then n, the deadline and the limits per request)')
  end
  -- Each request in turn, exactly as if it were a call of its own.
  local o = 1
  for r = 1, requests do
    local k0, m = FIRST[r], COUNT[r]
    -- Past its deadline: not evaluated (no penalty either), nothing written.
    local late = DEADLINE[r] > 0 and now > DEADLINE[r]
    local blocked = late
    -- The common request (PLAIN: one limit, no penalty box, no calendar, no lease) takes its
    -- algorithm's check, one read: admitted means spent and denied means nothing written,
    -- whether or not it is a shadow limit (the request has no other limit for a shadow denial
    -- to matter to), so the spending below is skipped.
    local plain = PLAIN[r] and not late
    if plain then
      TG_CAL_UNIT, TG_CAL_OFF = 0, 0
    end
    for i = k0 + 1, k0 + m do
      local code, remaining, reset, retry, delay = 6, 0, 0, 0, 0
      if plain then
        local sp = SPEC[i]
        code, remaining, reset, retry, delay = sp[1].check(KEYS[KEY[i]], now, sp[2], sp[3], sp[4])
      elseif not late then
        code, remaining, reset, retry, delay = decide(i, COST[i], true)
      end
      ADMITTED[i] = code == 1
      if code ~= 1 and not SHADOW[i] then
        blocked = true
      end
      reply[o + 1] = code
      reply[o + 2] = remaining
      reply[o + 3] = reset
      reply[o + 4] = retry
      reply[o + 5] = delay
      ROFF[i] = o
      o = o + 5
    end
    if not blocked and not plain then
      -- Spending re-reads each key, so a key listed twice is spent twice, like the memory store.
      for i = k0 + 1, k0 + m do
        if ADMITTED[i] then
          tg_cal(CALU[i], CALO[i])
          local key = KEYS[KEY[i]]
          ALGO[i].spend(key, now, LIMIT[i], INTERVAL[i], COST[i], MEMBER[i])
          if LWANT[i] and leases_open(i) then
            -- The lease (none while a reset settles): at most half of what the request left,
            -- spent now so no other gateway can spend it.
            local g
            if ALGO[i] == ALGOS[1] then
              g = tb_lease(key, now, LIMIT[i], INTERVAL[i], LWANT[i], LLIFE[i])
            else
              local _, r = ALGO[i].eval(key, now, LIMIT[i], INTERVAL[i], 0)
              g = mmin(LWANT[i], floor(r / 2))
              if g >= 1 then
                ALGO[i].spend(key, now, LIMIT[i], INTERVAL[i], g, MEMBER[i])
              end
            end
            if g >= 1 then
              reply[ROFF[i] + 1] = 5
              reply[ROFF[i] + 5] = g
            end
          end
        end
      end
    end
  end
  return pack(reply, o)
end

-- reset: the marker keys (see the header).
local function run_reset()
  local life, lease = tonum(ARGV[3]), tonum(ARGV[4])
  if #ARGV ~= 4 or not tg_whole(life, 1, TG_MAX_SPAN) or not tg_whole(lease, 0, TG_MAX_SPAN) then
    return redis.error_reply('ERR tollgate: bad arguments (want reset, now, life_ms, lease_ms)')
  end
  local at = sfmt('%d:%d', now, now + lease * 1000)
  for i = 1, #KEYS do
    rcall('SET', KEYS[i], at, 'PX', sfmt('%d', life))
  end
  return pack(reply, 1)
end

-- True when limit i was reset at or after `now` (its marker says so): a refund of units spent
-- at `now` belongs to the count the reset deleted.
local function reset_since(i)
  local m = reset_marker(i)
  return m ~= nil and now <= m
end

-- peek, refund, debit, renew: the limits one after the other from ARGV[3].
local function run_other()
  local b = 2
  while b < #ARGV do
    b = parse_limit(b)
    if b == nil then
      return redis.error_reply('ERR tollgate: bad arguments for limit ' .. (nlimits + 1))
    end
  end
  if nkeys ~= #KEYS then
    return redis.error_reply('ERR tollgate: bad arguments (want mode, now, the limits)')
  end
  if mode == 'peek' then
    local o = 1
    for i = 1, nlimits do
      local exists = rcall('EXISTS', KEYS[KEY[i]]) == 1 or (PKEY[i] and penalty_of(i))
      if exists then
        local code, remaining, reset, retry, delay = decide(i, 0, false)
        reply[o + 1] = code
        reply[o + 2] = remaining
        reply[o + 3] = reset
        reply[o + 4] = retry
        reply[o + 5] = delay
      else
        reply[o + 1] = 2
        reply[o + 2] = 0
        reply[o + 3] = 0
        reply[o + 4] = 0
        reply[o + 5] = 0
      end
      o = o + 5
    end
    return pack(reply, o)
  elseif mode == 'refund' then
    for i = 1, nlimits do
      if ALGO[i] == ALGOS[6] or not reset_since(i) then
        tg_cal(CALU[i], CALO[i])
        ALGO[i].refund(KEYS[KEY[i]], now, LIMIT[i], INTERVAL[i], COST[i], MEMBER[i])
      end
    end
    return pack(reply, 1)
  elseif mode == 'debit' or mode == 'renew' then
    -- The algorithms that take this mode (ALGOS: debit for the buckets and windows, renew for
    -- concurrency); the others are skipped. A calendar only matters to the windows.
    for i = 1, nlimits do
      local f = ALGO[i][mode]
      if f then
        tg_cal(CALU[i], CALO[i])
        f(KEYS[KEY[i]], now, LIMIT[i], INTERVAL[i], COST[i], MEMBER[i])
      end
    end
    return pack(reply, 1)
  end
  return redis.error_reply('ERR tollgate: unknown mode')
end

-- One call: KEYS and ARGV as the header describes. Everything per call is set here.
local function tg_run(keys, argv)
  KEYS, ARGV, mode = keys, argv, argv[1]
  tg_begin(mode, keys)
  if ARGV[2] == nil or ARGV[2] == '' then
    local t = rcall('TIME')
    now = tonum(t[1]) * 1000000 + tonum(t[2])
  else
    now = tonum(ARGV[2])
  end
  if not tg_whole(now, 0, TG_MAX_NOW) then
    return redis.error_reply('ERR tollgate: bad arguments (now)')
  end
  if not ALGO then
    -- Once per library load (once per run under EVAL): parse_limit writes every field of every
    -- limit it parses, and nothing reads past nlimits, so reusing them is exact; building 20
    -- tables a call was a tenth of a one-request call. They keep the size of the largest call
    -- (numbers, and holders of at most 64 bytes), which the gateway's batches bound.
    ALGO, LIMIT, INTERVAL, COST, SHADOW, MEMBER, KEY, PKEY, PBASE, PMAX = {}, {}, {}, {}, {}, {}, {}, {}, {}, {}
    MKEY, CALU, CALO, LWANT, LLIFE = {}, {}, {}, {}, {}
    FIRST, COUNT, DEADLINE, PLAIN, ADMITTED, ROFF, SPEC = {}, {}, {}, {}, {}, {}, {}
  end
  nlimits, nkeys = 0, 0
  -- The reply's table outlives the call too: it is written from reply[1] on, and only the
  -- call's own entries are packed.
  if not reply then
    reply = {}
  end
  reply[1] = now
  if mode == 'check' then
    return run_check()
  elseif mode == 'reset' then
    return run_reset()
  end
  return run_other()
end
