-- Acquire, fast paths (req_* as in acquire.lua). The new hold's entry is
-- `mine_before .. token .. mine_after`; mine_waiter() is this request's queue entry.
local expires, waiter_expires = now + req_ttl, now + req_waiter_lease
-- When the request arrived: now, or as long ago as it waited in its process
-- (req_waited, a transfer's or a gate's; see place() in acquire.lua).
local arrived = now_us
if req_waited then arrived = now_us - req_waited end
local mine_before = '\30' .. req_lease .. '\31' .. req_owner .. '\31' .. req_kind .. '\31' ..
  req_permits .. '\31'
local mine_after = '\31' .. req_wall .. '\31' .. req_host .. '\31' .. req_pid .. '\31' ..
  expires .. '\31' .. req_channel .. (req_value and '\31' .. req_value or '')
local function mine_waiter()
  return '\30' .. req_lease .. '\31' .. req_kind .. '\31' .. req_fair .. '\31' .. req_owner ..
    '\31' .. req_permits .. '\31' .. req_host .. '\31' .. req_pid .. '\31' .. string.format('%d', arrived) .. '\31' ..
    req_channel .. '\31' .. req_ttl .. '\31' .. req_waiter_lease .. '\31' .. waiter_expires ..
    (req_value and '\31' .. req_value or '')
end

-- A fair writer not yet queued (req_fresh says it cannot be: its first attempt; else
-- look), held by one unexpired hold of another owner, no waiter lease ended: queue at
-- the tail by rewriting the header and appending the entry, without reading or
-- rewriting the queue (not in a transfer, nor after a wait in its process:
-- req_released).
if req_fair == '1' and req_enqueue == '1' and req_kind == 'exclusive' and not req_released
    and fixed
    and not dirty and H ~= '' and he > now and (q == 0 or m > now)
    and not string.find(H, '\30', 2, true) then
  local queued = false
  if req_fresh ~= '1' then
    whole()
    queued = string.find(raw, '\30' .. req_lease .. '\31', 1, true)
  end
  local h = hold_at(1)
  -- (Behind a semaphore's permit the rules refuse it: acquire.lua says so.)
  if not queued and h.o ~= req_owner and h.k ~= 'permit' then
    q = q + 1
    if m == 0 or waiter_expires < m then m = waiter_expires end
    redis.call('SETRANGE', key, 0, header())
    redis.call('APPEND', key, mine_waiter())
    local left = tonumber(h.e) - now
    return reply.busy{position = q, retry_in = left, watermark = 0, owner = h.o, host = h.n,
      pid = h.i, token = h.t, acquired = h.a, lease_left = left, holds = 1, kind = h.k,
      permits = h.p, value = h.v or false, released = released_before}
  end
end
