-- tollgate: concurrency slots (algorithm code 6) (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis/protocol.rs concatenates the fragments into one script;
-- check.lua dispatches code 6 to the functions below. Mirrors src/limiter/algorithm/
-- concurrency.rs: at most `limit` requests of the key in flight at once, across the fleet.
--
-- KEY   one ZSET per limit: member = the holder (one request on one gateway, "<node>:<n>"),
--       score = the instant (integer microseconds) its slot expires unless renewed. Slots at or
--       before `now` are removed whenever a check evaluates the key, so the slots of a crashed
--       gateway free themselves after the slot time to live. The key expires (PEXPIREAT) with
--       its latest slot. A key of another type (a reload changed the algorithm) holds no slots:
--       it is replaced on the first take. A sliding log's ZSET (scores in the past) reads as
--       expired slots.
-- ARGV  (per key, passed by check.lua) limit = slots, interval = slot time to live in
--       microseconds, cost = slots this request takes (1; 0 for a peek), member = the holder.
-- Reply (per key) allowed (1/0), remaining (free slots after this request), reset_us (0, or
--       1 s when denied), retry_after_us (1 s when denied: slots free when requests end, which
--       cannot be predicted), delay_us (0).

local CC_RETRY = 1000000

-- Slots held at `now`; in a check (TG_WRITE) the expired ones are removed first.
local function cc_count(key, now)
  tg_forget(key)
  if TG_WRITE then
    local _, bad = tg_read('ZREMRANGEBYSCORE', key, '-inf', sfmt('%d', now))
    if bad then
      return 0
    end
    return rcall('ZCARD', key)
  end
  local n, bad = tg_read('ZCOUNT', key, sfmt('(%d', now), '+inf')
  if bad then
    return 0
  end
  return n
end

local function cc_eval(key, now, limit, ttl, cost)
  local n = cc_count(key, now)
  if n + cost <= limit then
    return true, limit - n - cost, 0, 0, 0
  end
  return false, mmax(limit - n, 0), CC_RETRY, CC_RETRY, 0
end

-- The key lives as long as its latest slot.
local function cc_expire(key)
  local last = rcall('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    rcall('PEXPIREAT', key, tg_at_ms(tonum(last[2])))
  end
end

-- Take a slot for `member` until now + ttl (cost 0, a probe, takes none).
local function cc_take(key, now, limit, ttl, cost, member)
  if cost == 0 then
    return
  end
  local t = rcall('TYPE', key)['ok']
  if t ~= 'zset' and t ~= 'none' then
    rcall('DEL', key)
  end
  rcall('ZADD', key, sfmt('%d', now + ttl), member)
  cc_expire(key)
  tg_forget(key)
end

-- Free `member`'s slot (refund mode: the request ended, or was rejected elsewhere).
local function cc_release(key, now, limit, ttl, cost, member)
  tg_read('ZREM', key, member)
  tg_forget(key)
end

-- Push `member`'s slot out to now + ttl, if it still holds one (renew mode).
local function cc_renew(key, now, limit, ttl, cost, member)
  local score = tonum((tg_read('ZSCORE', key, member)))
  if score and score > now then
    rcall('ZADD', key, 'XX', sfmt('%d', now + ttl), member)
    cc_expire(key)
  end
  tg_forget(key)
end
