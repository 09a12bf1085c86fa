-- tollgate: entry point of the combined limit script (its last fragment).
--
-- src/limiter/redis.rs concatenates common.lua, token_bucket.lua, leaky_bucket.lua,
-- fixed_window.lua, sliding_log.lua, sliding_window.lua and this file into ONE script, run
-- with EVALSHA (EVAL on NOSCRIPT). One call checks every limit of a request that lives on one
-- Redis Cluster slot, whatever their algorithms; limits on other slots get their own call.
--
-- KEYS  the limit keys, all sharing one {hash tag} (one slot). May be empty (probe).
-- ARGV[1]  mode: "check" | "refund" | "peek"
-- ARGV[2]  now in microseconds since the epoch, or "" to read Redis TIME (the normal case:
--          every gateway then agrees on time; tests pass an explicit now)
-- A limit is described by 5 ARGV: algorithm code (1 token_bucket, 2 leaky_bucket,
--   3 fixed_window, 4 sliding_log, 5 sliding_window), limit, interval_us (buckets:
--   microseconds per unit; windows: the window), cost, shadow (1 = never blocks the request).
--
-- check: a BATCH of requests, evaluated one after the other exactly as if each had been its
--   own call (the gateway batches the requests that are waiting for the same slot, so a busy
--   slot costs one round trip and one script run for many requests):
--   ARGV[3] = R, the number of requests; then per request: n (its limit count) followed by
--   5 ARGV per limit. KEYS holds every request's keys, request after request.
--   Per request: every key is evaluated; the request is blocked when a non-shadow key denies.
--   When not blocked, every admitted key is spent (a denied shadow key spends nothing) and
--   gets its expiry; when blocked, nothing is written at all (rejected requests are never
--   counted). A later request in the batch sees what the earlier ones spent.
-- peek and refund: 5 ARGV per key, in KEYS order.
--
-- Reply, every mode: the numbers
--   { now, allowed_1, remaining_1, reset_us_1, retry_after_us_1, delay_us_1, allowed_2, ... }
--   with one 5-tuple per key, in KEYS order (for check: request after request; refund: none),
--   PACKED: one binary string of little-endian IEEE doubles, 8 bytes per number (exact: every
--   value is an integer in 0 .. 2^53). A client then parses one bulk string instead of 1 + 5 n
--   integers, which for the gateway's Redis client was the costliest part of a batched request.
--   allowed is 1 or 0, and 2 in a peek where the key does not exist.
-- peek: as a cost-0 check with cost forced to 0, writing nothing (state of another shape is
--   converted in the reply only).
-- Every limit argument is checked before anything runs: whole numbers, limit 1..10^12,
--   interval 1..10 years in us (buckets: limit * interval too), cost 0..10^12, sliding log
--   limit and cost at most 10,000, shadow 0 or 1, now below 2^52. Anything else (negative,
--   fractional, non-finite, huge) is an error reply and changes nothing.
-- refund: ARGV[2] must be the `now` the check used (or "" for Redis time); gives back `cost`
--   on every key (see each algorithm's *_refund). Reply: { now }, packed.

local ALGOS = {
  { eval = tb_eval, spend = tb_spend, refund = tb_refund },
  { eval = lb_eval, spend = lb_spend, refund = lb_refund },
  { eval = fw_eval, spend = fw_spend, refund = fw_refund },
  { eval = sl_eval, spend = sl_spend, refund = sl_refund },
  { eval = sw_eval, spend = sw_spend, refund = sw_refund },
}

local mode = ARGV[1]
local now
if ARGV[2] == nil or ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[2])
end
local n = #KEYS
if not tg_whole(now, 0, TG_MAX_NOW) then
  return redis.error_reply('ERR tollgate: bad arguments (now)')
end

-- Parse the 5 arguments starting after ARGV[b]; nil unless every one is a whole number within
-- the bounds (common.lua) and the shadow flag is 0 or 1.
local function args_at(b)
  local code = tg_num(ARGV[b + 1])
  local limit = tg_num(ARGV[b + 2])
  local interval = tg_num(ARGV[b + 3])
  local cost = tg_num(ARGV[b + 4])
  local shadow = ARGV[b + 5]
  if not tg_whole(code, 1, 5) or not tg_whole(limit, 1, TG_MAX_UNITS)
    or not tg_whole(interval, 1, TG_MAX_SPAN) or not tg_whole(cost, 0, TG_MAX_UNITS)
    or (shadow ~= '0' and shadow ~= '1') then
    return nil
  end
  if (code == 1 or code == 2) and limit * interval > TG_MAX_SPAN then
    return nil
  end
  if code == 4 and (limit > TG_MAX_LOG or cost > TG_MAX_LOG) then
    return nil
  end
  return ALGOS[code], limit, interval, cost, shadow == '1'
end

-- Parse the 5 arguments of key j (peek and refund layout).
local function args(j)
  return args_at(2 + (j - 1) * 5)
end

local reply = { now }

-- The reply, packed: one string of little-endian doubles, in chunks (unpack() puts every value
-- on the Lua stack, which holds about 8000).
local function pack(values)
  local parts = {}
  for i = 1, #values, 1000 do
    local j = math.min(i + 999, #values)
    parts[#parts + 1] = struct.pack('<' .. string.rep('d', j - i + 1), unpack(values, i, j))
  end
  return table.concat(parts)
end

if mode == 'check' then
  local argc = #ARGV
  local requests = tonumber(ARGV[3])
  if requests == nil then
    return redis.error_reply('ERR tollgate: bad arguments (want a request count)')
  end
  -- Parse and validate the whole batch before anything is written. Key i's limit goes to
  -- ALGO[i], LIMIT[i], ... (parsed once, used by evaluation and spending); request r owns
  -- keys FIRST[r] + 1 .. FIRST[r] + COUNT[r].
  local ALGO, LIMIT, INTERVAL, COST, SHADOW, FIRST, COUNT = {}, {}, {}, {}, {}, {}, {}
  local b, k = 3, 0
  for r = 1, requests do
    local m = tg_num(ARGV[b + 1])
    if m == nil or m < 0 or b + 1 + 5 * m > argc then
      return redis.error_reply('ERR tollgate: bad arguments (request layout)')
    end
    FIRST[r], COUNT[r] = k, m
    b = b + 1
    for _ = 1, m do
      k = k + 1
      local algo, limit, interval, cost, shadow = args_at(b)
      if algo == nil then
        return redis.error_reply('ERR tollgate: bad arguments for key ' .. k)
      end
      ALGO[k], LIMIT[k], INTERVAL[k], COST[k], SHADOW[k] = algo, limit, interval, cost, shadow
      b = b + 5
    end
  end
  if b ~= argc or k ~= n then
    return redis.error_reply('ERR tollgate: bad arguments (want R, then n and 5 per key per request)')
  end
  -- Each request in turn, exactly as if it were a call of its own.
  local admitted = {}
  local o = 1
  for r = 1, requests do
    local k0, m = FIRST[r], COUNT[r]
    local blocked = false
    for i = k0 + 1, k0 + m do
      local ok, remaining, reset, retry, delay = ALGO[i].eval(KEYS[i], now, LIMIT[i], INTERVAL[i], COST[i])
      admitted[i] = ok
      if not ok and not SHADOW[i] then
        blocked = true
      end
      reply[o + 1] = ok and 1 or 0
      reply[o + 2] = remaining
      reply[o + 3] = reset
      reply[o + 4] = retry
      reply[o + 5] = delay
      o = o + 5
    end
    if not blocked then
      -- Spending re-reads each key, so a key listed twice is spent twice, like the memory store.
      for i = k0 + 1, k0 + m do
        if admitted[i] then
          ALGO[i].spend(KEYS[i], now, LIMIT[i], INTERVAL[i], COST[i])
        end
      end
    end
  end
  return pack(reply)
elseif mode ~= 'check' and #ARGV ~= 2 + 5 * n then
  return redis.error_reply('ERR tollgate: bad arguments (want mode, now, 5 per key)')
elseif mode == 'peek' then
  for j = 1, n do
    local algo, limit, interval = args(j)
    if algo == nil then
      return redis.error_reply('ERR tollgate: bad arguments for key ' .. j)
    end
    local o = #reply
    if redis.call('EXISTS', KEYS[j]) == 1 then
      local ok, remaining, reset, retry, delay = algo.eval(KEYS[j], now, limit, interval, 0)
      reply[o + 1] = ok and 1 or 0
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
  end
  return pack(reply)
elseif mode == 'refund' then
  for j = 1, n do
    local algo, limit, interval, cost = args(j)
    if algo == nil then
      return redis.error_reply('ERR tollgate: bad arguments for key ' .. j)
    end
    algo.refund(KEYS[j], now, limit, interval, cost)
  end
  return pack(reply)
end
return redis.error_reply('ERR tollgate: unknown mode')
