-- Acquire. The request, each field a local req_NAME (request.rs's Acquire): lease, owner,
-- kind (exclusive|shared|permit), permits, ttl ms, fair (0|1), enqueue (0|1), host, pid,
-- channel (the client's), wall (the client's clock, ms: display only), waiter_lease ms
-- (how long a place in the queue lasts unless renewed), fresh (1: the first attempt of
-- this acquisition, so not queued; else 0); in a transfer, released (the hold released
-- first) and waited (how long, µs, the request already waited in its process); value
-- (nil for none), kept with the hold it is granted (a re-entry keeps the holder's).
-- Replies (reply.rs): reply.granted (token, holds, released) when granted;
--   reply.busy when not (position 0: not queued, retry_in -1: no time; the holder in
--   the way: owner, host, pid, token, acquired ms, lease_left ms, holds, kind, permits,
--   value (false: none), owner '' when none; released: 1 if transfer.lua released a hold first, else 0);
--   reply.conflict (code, kind, permits) when the lock rules refuse the request (code as
--   Refusal::code in rules.rs; kind and permits of the holder or waiter it met).
local lease, owner, kind, permits = req_lease, req_owner, req_kind, req_permits
local fair, enqueue = req_fair == '1', req_enqueue == '1'
local host, pid, channel, wall = req_host, req_pid, req_channel, req_wall
-- (`expires`, `waiter_expires` and the new entries come from acquire_fast.lua.)

local function granted(token, count)
  save()
  return reply.granted{token = token, holds = count, released = released_before}
end

-- A retry of a request already granted: the same answer again.
local at, after = find_hold(lease)
if at then
  local h = hold_at(at)
  if expires > tonumber(h.e) then
    h.e = expires
    splice_hold(at, after, pack_hold(h))
  end
  return granted(h.t, (holds_of(owner)))
end

-- The lock rules (rules.rs), which Rust also states: a refusal answers with its code and
-- the kind it met, and Rust writes the message.
local function refuse(code, used)
  save()
  return reply.conflict{code = code, kind = used.k, permits = used.p}
end

-- 1. One primitive per name, held or awaited. Every holder and waiter was admitted by
-- this rule, so the first hold and the first other waiter speak for all of them.
local me = find_waiter(lease)
if not me then
  local used = H ~= '' and hold_at(1) or nil
  if not used and q > 0 then used = waiter_at(1) end
  if used then
    if (used.k == 'permit') ~= (kind == 'permit') then return refuse('primitive', used) end
    if kind == 'permit' and used.p ~= permits then return refuse('permits', used) end
  end
end

-- 2. Re-entry by the same owner: one more hold, the same token; but a reader may not
-- upgrade.
for _, h in ipairs(holds()) do
  if h.o == owner then
    if h.k == 'shared' and kind == 'exclusive' then return refuse('upgrade', h) end
    add_hold(pack_hold({l = lease, o = owner, k = h.k, p = h.p, t = h.t, a = h.a, n = host,
                        i = pid, e = expires, c = channel, v = h.v}), expires)
    if remove_waiter(lease) then bumped = true end
    return granted(h.t, (holds_of(owner)))
  end
end

-- 3 and 4: holders in the way, waiters ahead that may not be passed.
local blocking_holder = holder_in_the_way(kind, tonumber(permits))

-- How many waiters are before us (all of them when we are not queued); only writers
-- when `writers`.
local function before(writers)
  local n, s = 0, 1
  while s < (me or #W + 1) do
    local w, next = waiter_at(s)
    if not writers or w.k ~= 'shared' then n = n + 1 end
    s = next
  end
  return n
end

-- Where a request not yet queued goes: after the waiters that arrived before it (a
-- transfer's request may have waited in its process for a while: it keeps the place it
-- would have had), else at the end. How many are ahead, and where its entry goes in W.
local function place()
  if arrived == now_us then return q, #W + 1 end
  local n, s = 0, 1
  while s <= #W do
    local w, next = waiter_at(s)
    if arrival_us(w.a) > arrived then break end
    n, s = n + 1, next
  end
  return n, s
end

-- Fair: nobody ahead, except readers let in together. Non-fair: barge, except that a
-- reader does not pass a waiting writer (no writer starvation).
local ahead = 0
if kind == 'shared' then
  ahead = before(true)
elseif fair then
  ahead = me and before(false) or (place())
end

if not blocking_holder and ahead == 0 then
  local t = next_token()
  add_hold(mine_before .. t .. mine_after, expires)
  remove_waiter(lease)
  return granted(t, 1)
end

local retry_at = -1
if blocking_holder then
  retry_at = select(2, holds_of(blocking_holder.o))
elseif q > 0 then
  retry_at = tonumber(waiter_at(1).e)
end
local position = 0
local waiter_lease = tonumber(req_waiter_lease)
if enqueue and me then
  -- Refresh the waiter lease only once a quarter of it is gone.
  local w, next = waiter_at(me)
  if tonumber(w.e) < now + waiter_lease * 3 / 4 then
    w.e = now + waiter_lease
    W = string.sub(W, 1, me - 1) .. pack_waiter(w) .. string.sub(W, next)
    dirty = true
  end
  position = before(false) + 1
elseif enqueue then
  local n, at = place()
  W = string.sub(W, 1, at - 1) .. mine_waiter() .. string.sub(W, at)
  q = q + 1
  if m == 0 or waiter_expires < m then m = waiter_expires end
  dirty = true
  position = n + 1
end
save()
local retry_in = -1
if retry_at >= 0 then retry_in = retry_at - now end
local h = holder_reply(blocking_holder)
return reply.busy{position = position, retry_in = retry_in, watermark = 0, owner = h.owner,
  host = h.host, pid = h.pid, token = h.token, acquired = h.acquired, lease_left = h.lease_left,
  holds = h.holds, kind = h.kind, permits = h.permits, value = h.value,
  released = released_before}
