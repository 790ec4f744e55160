-- Rate-limiter decisions (GCRA), several in one call, in the order asked: tasks of one
-- client that ask at once share a round trip, the clock read and each key's GET and SET.
-- The arithmetic is that of leasehold::store::gcra (src/rate.rs), line for line; change
-- both together.
-- KEYS: the limiters' keys, lh:rate:{NAME}, each once: its theoretical arrival time
--   (TAT), in µs of the server's clock, as a whole number; it expires when the limiter
--   is back to full burst, so an idle limiter leaves nothing behind.
-- ARGV: REQ_WIDTH arguments per decision; `read_request(i)` names those of the i-th
--   (0-based) as locals: req_key (its key's index in KEYS), req_interval_us, req_burst,
--   req_units, req_max_wait_us (whole numbers; every time here stays below 2^53 µs,
--   exact in Lua's doubles).
-- Reply: a list of reply.decision (allowed: 1 or 0, wait_us, remaining, reset_after_us),
--   one per decision; allowed is -1 for a key that does not hold a time (its decision
--   only: the others stand).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tats, corrupt, changed, out = {}, {}, {}, {}
for i = 0, #ARGV / REQ_WIDTH - 1 do
  read_request(i)
  local k = tonumber(req_key)
  local interval, burst = tonumber(req_interval_us), tonumber(req_burst)
  local units, max_wait = tonumber(req_units), tonumber(req_max_wait_us)
  if tats[k] == nil and not corrupt[k] then
    -- pcall: a key of another type (WRONGTYPE) spoils its own decisions only.
    local kept = redis.pcall('GET', KEYS[k])
    tats[k] = now
    if type(kept) == 'table' then
      corrupt[k] = true
    elseif kept then
      -- A time is a whole number of µs below 2^53: not "nan", "inf", "1e300" or 0.5,
      -- which tonumber also reads.
      local read = tonumber(kept)
      if read and read >= 0 and read < 9007199254740992 and read == math.floor(read) then
        tats[k] = read
      else
        corrupt[k] = true
      end
    end
  end
  if corrupt[k] then
    out[#out + 1] = reply.decision{allowed = -1, wait_us = 0, remaining = 0, reset_after_us = 0}
  else
    local tau = interval * burst
    local tat = tats[k]
    if tat < now then tat = now end
    local new_tat = tat + units * interval
    local wait = new_tat - now - tau
    if wait < 0 then wait = 0 end
    local function left(at)
      local room = now + tau - at
      if room <= 0 then return 0 end
      return math.floor(room / interval)
    end
    if wait <= max_wait then
      tats[k], changed[k] = new_tat, true
      out[#out + 1] = reply.decision{allowed = 1, wait_us = wait, remaining = left(new_tat),
        reset_after_us = new_tat - now}
    else
      out[#out + 1] = reply.decision{allowed = 0, wait_us = wait, remaining = left(tat),
        reset_after_us = tat - now}
    end
  end
end
for k in pairs(changed) do
  local tat = tats[k]
  redis.call('SET', KEYS[k], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000))
end
return out
