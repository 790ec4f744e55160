-- One rate-limiter decision (GCRA). The same arithmetic as leasehold::store::gcra
-- (src/rate.rs), line for line; change both together.
-- KEYS[1]: the limiter's key, lh:rate:{NAME}: its theoretical arrival time (TAT), in µs
--   of the server's clock, as a whole number; it expires when the limiter is back to
--   full burst, so an idle limiter leaves nothing behind.
-- Request: req_interval_us, req_burst, req_units, req_max_wait_us (whole numbers; every
--   time here stays below 2^53 µs, exact in Lua's doubles).
-- Reply: reply.decision (allowed: 1 or 0, wait_us, remaining, reset_after_us); on a key
--   that is not a number, an error starting with LHCORRUPT.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval, burst = tonumber(req_interval_us), tonumber(req_burst)
local units, max_wait = tonumber(req_units), tonumber(req_max_wait_us)
local tau = interval * burst
local tat = now
local kept = redis.call('GET', KEYS[1])
if kept then
  tat = tonumber(kept)
  if not tat then
    return redis.error_reply('LHCORRUPT ' .. KEYS[1] .. ' does not hold a time')
  end
  if tat < now then tat = now end
end
local new_tat = tat + units * interval
local wait = new_tat - now - tau
if wait < 0 then wait = 0 end
local function left(at)
  local room = now + tau - at
  if room <= 0 then return 0 end
  return math.floor(room / interval)
end
if wait <= max_wait then
  redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000))
  return reply.decision{allowed = 1, wait_us = wait, remaining = left(new_tat),
    reset_after_us = new_tat - now}
end
return reply.decision{allowed = 0, wait_us = wait, remaining = left(tat), reset_after_us = tat - now}
