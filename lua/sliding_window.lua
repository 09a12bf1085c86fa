-- tollgate: sliding window counter (algorithm code 5) (fragment of the combined limit script).
--
-- A fragment: src/limiter/redis.rs concatenates common.lua, token_bucket.lua,
-- leaky_bucket.lua, fixed_window.lua, sliding_log.lua, this file and check.lua into one
-- script; check.lua dispatches code 5 to the functions below. Mirrors `roll_sliding` /
-- `sliding_eval` / `spend` / `refund` in src/limiter/algorithm.rs, including the
-- floating-point expressions, written in the same order so both stores round identically:
--   estimate = previous * (window - elapsed) / window + current;  admit if estimate + cost <= limit
--
-- KEY   one HASH per limit: i = index of the current window (floor(now / window)),
--       p = units admitted in window i - 1, c = units admitted in window i, q = "s:<window>"
--       (the shape it was written under). Expires (PEXPIREAT) at the end of window i + 1, after
--       which p would be 0 too. A key of another shape (a reload changed the algorithm or the
--       window) is converted first: the units it still holds count in the current window.
-- ARGV  (per key, passed by check.lua) limit = units per window, interval = window in
--       microseconds, cost = units this request takes.
-- Reply (per key) allowed (1/0), remaining (floored), reset_us, retry_after_us (0 when
--       allowed), delay_us (0).

-- Write (or, in peek, only remember) window `index` with counts prev, curr.
local function sw_put(key, index, prev, curr, w, q)
  if TG_WRITE then
    rcall('HSET', key, 'i', tg_dec(index), 'p', tg_dec(prev), 'c', tg_dec(curr), 'q', q)
    rcall('PEXPIREAT', key, tg_at_ms(tg_start(index + 2, w)))
  end
  tg_remember_fields('sw', key, 4, index, prev, curr, q)
end

-- The state rolled to now's window: index, previous, current, and whether the stored window is
-- now's (so a spend only moves the count). State of another shape is converted first.
local function sw_roll(key, now, limit, w)
  local index = tg_index(now, w)
  local q = tg_shape('s', w)
  local r, bad = tg_read_key('sw', key, 'HMGET', 'i', 'p', 'c', 'q')
  if bad or (r and r[1] and r[4] ~= q) then
    local used = mmin(tg_used(key, now, w), limit)
    if TG_WRITE then
      rcall('DEL', key)
    end
    if used <= 0 then
      tg_remember('sw', key, false)
      return index, 0, 0, false
    end
    sw_put(key, index, 0, used, w, q)
    return index, 0, used, true
  end
  local i = nil
  if r and r[1] then
    i = tonum(r[1])
  end
  if i == index then
    return index, tonum(r[2]) or 0, tonum(r[3]) or 0, true
  elseif i ~= nil and i + 1 == index then
    return index, tonum(r[3]) or 0, 0, false
  end
  return index, 0, 0, false
end

local function sw_eval(key, now, limit, w, cost)
  local index, prev, curr = sw_roll(key, now, limit, w)
  -- This window [start, e1) and the next [e1, e2): equal lengths unless calendar-aligned.
  local start, e1, e2 = tg_start(index, w), tg_start(index + 1, w), tg_start(index + 2, w)
  w = e1 - start
  local elapsed = now - start
  local estimate = prev * (w - elapsed) / w + curr
  if estimate + cost <= limit then
    local reset = e1 - now
    if curr + cost > 0 then
      reset = e2 - now
    end
    return true, mmax(floor(limit - estimate - cost), 0), reset, 0, 0
  end
  local retry
  if curr + cost <= limit then
    -- Wait inside this window for the previous window's weight to decay.
    local e = math.ceil(w - (limit - curr - cost) * w / prev)
    retry = mmax(e - elapsed, 1)
  else
    -- Wait for the next window, where this window's count becomes `previous`.
    local nw = e2 - e1
    local e = mmax(math.ceil(nw - (limit - cost) * nw / curr), 0)
    retry = (w - elapsed) + e
  end
  local reset = e1 - now
  if curr > 0 then
    reset = e2 - now
  end
  return false, mmax(floor(limit - estimate), 0), reset, tg_int(retry), 0
end

-- Spend `cost` units on the state sw_roll gave (index, prev, curr, same).
local function sw_add(key, w, cost, index, prev, curr, same)
  local q = tg_shape('s', w)
  if same then
    -- Same window: only the count moves; the expiry, set when the window began, stands.
    tg_remember_fields('sw', key, 4, index, prev, rcall('HINCRBY', key, 'c', tg_dec(cost)), q)
  else
    sw_put(key, index, prev, curr + cost, w, q)
  end
end

local function sw_spend(key, now, limit, w, cost)
  local index, prev, curr, same = sw_roll(key, now, limit, w)
  sw_add(key, w, cost, index, prev, curr, same)
end

-- A request whose only limit is this window (no penalty, no lease; check.lua): sw_eval, then on
-- admission what sw_spend would write, from the one roll (sw_spend's own would find the state
-- sw_eval rolled). Returns the allowed code (1 or 0) and the reply's 4 numbers.
local function sw_check(key, now, limit, w, cost)
  local index, prev, curr, same = sw_roll(key, now, limit, w)
  local start, e1, e2 = tg_start(index, w), tg_start(index + 1, w), tg_start(index + 2, w)
  local len = e1 - start
  local estimate = prev * (len - (now - start)) / len + curr
  if estimate + cost > limit then
    local _, remaining, reset, retry = sw_eval(key, now, limit, w, cost)
    return 0, remaining, reset, retry, 0
  end
  sw_add(key, w, cost, index, prev, curr, same)
  local reset = e1 - now
  if curr + cost > 0 then
    reset = e2 - now
  end
  return 1, mmax(floor(limit - estimate - cost), 0), reset, 0, 0
end

-- Move the units counted at `now` by `delta` (never below 0): in c if the window has not moved
-- since, in p if it moved on by exactly one window; later than that they no longer count
-- anyway. A key converted to another shape since is left alone.
local function sw_adjust(key, now, w, delta)
  local index = tg_index(now, w)
  local r = tg_read('HMGET', key, 'i', 'p', 'c', 'q')
  if not r or not r[1] or r[4] ~= tg_shape('s', w) then
    return
  end
  local i = tonum(r[1])
  if i == index then
    rcall('HSET', key, 'c', mmax((tonum(r[3]) or 0) + delta, 0))
    tg_forget(key)
  elseif i == index + 1 then
    rcall('HSET', key, 'p', mmax((tonum(r[2]) or 0) + delta, 0))
    tg_forget(key)
  end
end

-- Give back `cost` units counted at `now` (mirrors `refund` in src/limiter/algorithm).
local function sw_refund(key, now, limit, w, cost)
  sw_adjust(key, now, w, -cost)
end

-- Debit `cost` more units at `now` (`cost_from`), without checking: into the current count of
-- the window of `now` (the check's window while it lasts, else the one the cost was learned
-- in), so a debit is never dropped; never past twice the limit. Mirrors `debit` in
-- src/limiter/algorithm.
local function sw_debit(key, now, limit, w, cost)
  local index, prev, curr, same = sw_roll(key, now, limit, w)
  local q = tg_shape('s', w)
  local new = mmax(curr, mmin(curr + cost, 2 * limit))
  if same then
    -- Same window: only the count moves; the expiry, set when the window began, stands.
    rcall('HSET', key, 'c', new)
    tg_remember_fields('sw', key, 4, index, prev, new, q)
  else
    sw_put(key, index, prev, new, w, q)
  end
end
