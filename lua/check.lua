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
-- then 5 ARGV per key, in KEYS order:
--   algorithm code (1 token_bucket, 2 leaky_bucket, 3 fixed_window, 4 sliding_log,
--   5 sliding_window), limit, interval_us (buckets: microseconds per unit; windows: the window),
--   cost, shadow (1 = never blocks the request; 0 otherwise)
--
-- Reply, check and peek: a flat array of integers
--   { now, allowed_1, remaining_1, reset_us_1, retry_after_us_1, delay_us_1, allowed_2, ... }
-- check: every key is evaluated; the request is blocked when a non-shadow key denies. When
--   not blocked, every admitted key is spent (a denied shadow key spends nothing) and gets its
--   expiry; when blocked, nothing is written at all (rejected requests are never counted).
-- peek: as a cost-0 check with cost forced to 0, writing nothing; allowed = -1 where the key
--   does not exist.
-- refund: ARGV[2] must be the `now` the check used (or "" for Redis time); gives back `cost`
--   on every key (see each algorithm's *_refund). Reply: { now }.

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
if now == nil or #ARGV ~= 2 + 5 * n then
  return redis.error_reply('ERR tollgate: bad arguments (want mode, now, 5 per key)')
end

-- Parse the 5 arguments of key j.
local function args(j)
  local b = 2 + (j - 1) * 5
  local algo = ALGOS[tonumber(ARGV[b + 1])]
  local limit = tonumber(ARGV[b + 2])
  local interval = tonumber(ARGV[b + 3])
  local cost = tonumber(ARGV[b + 4])
  if algo == nil or limit == nil or interval == nil or interval <= 0 or cost == nil then
    return nil
  end
  return algo, limit, interval, cost, ARGV[b + 5] == '1'
end

local reply = { now }

if mode == 'check' then
  local admitted = {}
  local blocked = false
  for j = 1, n do
    local algo, limit, interval, cost, shadow = args(j)
    if algo == nil then
      return redis.error_reply('ERR tollgate: bad arguments for key ' .. j)
    end
    local ok, remaining, reset, retry, delay = algo.eval(KEYS[j], now, limit, interval, cost)
    admitted[j] = ok
    if not ok and not shadow then
      blocked = true
    end
    local o = #reply
    reply[o + 1] = ok and 1 or 0
    reply[o + 2] = remaining
    reply[o + 3] = reset
    reply[o + 4] = retry
    reply[o + 5] = delay
  end
  if not blocked then
    -- Spending re-reads each key, so a key listed twice is spent twice, like the memory store.
    for j = 1, n do
      if admitted[j] then
        local algo, limit, interval, cost = args(j)
        algo.spend(KEYS[j], now, limit, interval, cost)
      end
    end
  end
  return reply
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
      reply[o + 1] = -1
      reply[o + 2] = 0
      reply[o + 3] = 0
      reply[o + 4] = 0
      reply[o + 5] = 0
    end
  end
  return reply
elseif mode == 'refund' then
  for j = 1, n do
    local algo, limit, interval, cost = args(j)
    if algo == nil then
      return redis.error_reply('ERR tollgate: bad arguments for key ' .. j)
    end
    algo.refund(KEYS[j], now, limit, interval, cost)
  end
  return reply
end
return redis.error_reply('ERR tollgate: unknown mode')
