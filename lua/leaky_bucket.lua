-- tollgate: leaky bucket (algorithm code 2) (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, token_bucket.lua, this file,
-- fixed_window.lua, sliding_log.lua, sliding_window.lua and check.lua into one script. It
-- relies on token_bucket.lua (defined before it): a leaky bucket is the same GCRA state seen
-- from the other side (it starts empty and drains at `rate`; admitted requests wait
-- `level / rate` instead of bursting, like nginx `limit_req` without `nodelay`). Mirrors
-- `bucket_eval` in src/limiter/algorithm.rs with `Algorithm::LeakyBucket`.
--
-- KEY   one STRING per limit: `tat`, integer microseconds; the bucket is empty when tat <= now.
-- ARGV  (per key, passed by check.lua) limit = capacity, interval = microseconds per unit
--       (drain time of one unit), cost = units this request takes.
-- Reply (per key) allowed (1/0), remaining (floored units of room), reset_us (until empty),
--       retry_after_us (0 when allowed), delay_us = max(tat, now) - now: how long the
--       admitted request waits before it is forwarded (0 when denied).

local function lb_eval(key, now, limit, t, cost)
  return bucket_eval(key, now, limit, t, cost, true)
end

local function lb_check(key, now, limit, t, cost)
  return bucket_check(key, now, limit, t, cost, true)
end

-- Spending and refunding are the token bucket's: tat moves by cost * t.
local lb_spend = tb_spend
local lb_refund = tb_refund
