-- Acquire, fast paths (ARGV as in acquire.lua). The new hold's entry is
-- `mine_before .. token .. mine_after`; mine_waiter() is this request's queue entry.
local expires, waiter_expires = now + ARGV[5], now + ARGV[12]
-- When the request arrived: now, or as long ago as it waited in its process (ARGV[15],
-- a transfer's or a gate's; see place() in acquire.lua).
local arrived = now
if ARGV[15] then arrived = now - ARGV[15] end
local mine_before = '\30' .. ARGV[1] .. '\31' .. ARGV[2] .. '\31' .. ARGV[3] .. '\31' ..
  ARGV[4] .. '\31'
local mine_after = '\31' .. ARGV[11] .. '\31' .. ARGV[8] .. '\31' .. ARGV[9] .. '\31' ..
  expires .. '\31' .. ARGV[10]
local function mine_waiter()
  return '\30' .. ARGV[1] .. '\31' .. ARGV[3] .. '\31' .. ARGV[6] .. '\31' .. ARGV[2] .. '\31' ..
    ARGV[4] .. '\31' .. ARGV[8] .. '\31' .. ARGV[9] .. '\31' .. arrived .. '\31' .. ARGV[10] ..
    '\31' .. ARGV[5] .. '\31' .. ARGV[12] .. '\31' .. waiter_expires
end

-- A fair writer not yet queued (ARGV[13] says it cannot be: its first attempt; else
-- look), held by one unexpired hold of another owner, no waiter lease ended: queue at
-- the tail by rewriting the header and appending the entry, without reading or
-- rewriting the queue (not in a transfer, nor after a wait in its process: ARGV[14]).
if ARGV[6] == '1' and ARGV[7] == '1' and ARGV[3] == 'exclusive' and not ARGV[14] and fixed
    and not dirty and H ~= '' and he > now and (q == 0 or m > now)
    and not string.find(H, '\30', 2, true) then
  local queued = false
  if ARGV[13] ~= '1' then
    whole()
    queued = string.find(raw, '\30' .. ARGV[1] .. '\31', 1, true)
  end
  local h = hold_at(1)
  -- (Behind a semaphore's permit the rules refuse it: acquire.lua says so.)
  if not queued and h.o ~= ARGV[2] and h.k ~= 'permit' then
    q = q + 1
    if m == 0 or waiter_expires < m then m = waiter_expires end
    redis.call('SETRANGE', key, 0, header())
    redis.call('APPEND', key, mine_waiter())
    local left = tonumber(h.e) - now
    return {0, q, left, 0, h.o, h.n, h.i, h.t, h.a, left, 1, h.k, h.p, released_before}
  end
end
