-- Shared head of every leasehold script: one lock's state lives in five keys under one
-- hash tag, all passed in KEYS, so every check-and-change is one script in one cluster
-- slot.
--
-- KEYS (one hash tag, so one cluster slot): 1 the lock's record, lh:{NAME}; 2 its queue
-- (ZSET lease -> sequence number); 3 its waiters (HASH lease -> packed fields, see
-- `waiter`); 4 waiter lease expiries (ZSET lease -> ms); 5 the queue's non-shared
-- waiters (ZSET lease -> sequence number). The record (MessagePack):
--   t  last fencing token (never decreases; the key is never deleted, so tokens persist)
--   v  version: bumped when a hold or a waiter goes away (what waiters wait for)
--   s  last waiter sequence number (queue order)
--   q  how many waiters the queue holds (so that a call on a lock nobody waits for
--      sends no queue command at all)
--   h  holders: {o owner, k kind, p permits, t token, a acquired ms, d holds:
--        {l lease, n host, i pid, e expiry ms, c client channel}}
-- The queue lives in its own keys so that a call does not read or write all of it.
-- Expiry times are the server's (TIME), in ms; clients' clocks are never used for them
-- (a holder's "acquired" time is the client's wall clock, for display only).

local key, Q, W, E, X = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local clock = redis.call('TIME')
-- Milliseconds since the epoch.
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local raw = redis.call('GET', key)
local st
if raw then st = cmsgpack.unpack(raw) else st = {t = 0, v = 0, s = 0, h = {}, q = 0} end
local dirty = false
local bumped = false
-- Set by transfer.lua when the hold it hands over was still held; ends acquire replies.
local released_before = 0

local function bump()
  st.v = st.v + 1
  dirty = true
  bumped = true
end

-- A queued waiter, as the W hash keeps it: kind, fair, owner, permits, host, pid, since
-- ms, client channel, lease ttl ms, waiter lease ms (at most the ttl).
local FIELDS = {'k', 'f', 'o', 'p', 'n', 'i', 'a', 'c', 'x', 'y'}
local NUMERIC = {f = true, p = true, i = true, a = true, x = true, y = true}

local function waiter(lease)
  local s = redis.call('HGET', W, lease)
  if not s then return nil end
  local out, i, n = {l = lease}, 1, 1
  while n <= #FIELDS do
    local j = string.find(s, '\31', i, true)
    local field = string.sub(s, i, (j or 0) - 1)
    local name = FIELDS[n]
    if NUMERIC[name] then out[name] = tonumber(field) else out[name] = field end
    if not j then break end
    i, n = j + 1, n + 1
  end
  return out
end

local function pack_waiter(t)
  local parts = {}
  for n, name in ipairs(FIELDS) do parts[n] = tostring(t[name]) end
  return table.concat(parts, '\31')
end

-- The queue's keys outlive their waiters by at most twice the longest waiter lease
-- (MAX_WAITER_LEASE, 5 s): a queue whose waiters all died leaves nothing behind. Set
-- when the queue starts, topped up by arrivals when half of it is gone, and whenever a
-- waiter renews its place (every waiter still queued does within half a waiter lease),
-- so the keys last as long as anyone waits.
local function keep_queue()
  for _, k in ipairs({Q, W, E, X}) do redis.call('PEXPIRE', k, 10000) end
end

local function remove_waiter(lease)
  if st.q == 0 or redis.call('ZREM', Q, lease) == 0 then return false end
  st.q = st.q - 1
  dirty = true
  redis.call('ZREM', X, lease)
  redis.call('HDEL', W, lease)
  redis.call('ZREM', E, lease)
  return true
end

-- Drop expired holds (and holders left without holds) and expired waiters; the
-- holders are rebuilt only when one expired, the queue is asked for expired entries.
local function prune()
  local expired = false
  for _, h in ipairs(st.h) do
    for _, d in ipairs(h.d) do if d.e <= now then expired = true end end
  end
  if expired then
    local holders = {}
    for _, h in ipairs(st.h) do
      local holds = {}
      for _, d in ipairs(h.d) do
        if d.e > now then holds[#holds + 1] = d end
      end
      h.d = holds
      if #holds > 0 then holders[#holders + 1] = h end
    end
    st.h = holders
    bump()
  end
  if st.q == 0 then return end
  local gone = redis.call('ZRANGEBYSCORE', E, '-inf', now)
  for _, lease in ipairs(gone) do remove_waiter(lease) end
  if #gone > 0 then bump() end
end

-- The first holder that a new `kind` holder could not stand beside, if any.
local function holder_in_the_way(kind, permits)
  if kind == 'permit' and #st.h >= permits then return st.h[1] end
  for _, h in ipairs(st.h) do
    local compatible = (h.k == 'shared' and kind == 'shared') or (h.k == 'permit' and kind == 'permit')
    if not compatible then return h end
  end
  return nil
end

-- Messages to publish, by client channel: acquisitions to wake ("LEASE"), granted here
-- ("LEASE=TOKEN:MS"), or holds taken away ("LEASE!").
local messages, channels = {}, {}
local function tell(channel, item)
  if not messages[channel] then messages[channel] = {}; channels[#channels + 1] = channel end
  table.insert(messages[channel], item)
end

-- Fair waiters at the head of the queue that can get in now get the lock here: no round
-- trip to come and take it, and nobody can pass them. The hold lasts a waiter lease (its
-- client counts it from its last request, which is earlier, and renews to the full TTL
-- at a third of it), so a waiter that died does not keep the lock for a whole TTL.
-- Returns whether the head should still be woken: a non-fair head, or one that must
-- come itself (re-entry); not a fair head that a holder keeps out.
local function hand_over()
  while st.q > 0 do
    local head = redis.call('ZRANGE', Q, 0, 0)[1]
    if not head then
      -- The queue's keys expired with their last waiters (see keep_queue).
      st.q, dirty = 0, true
      return false
    end
    local w = waiter(head)
    if w.f ~= 1 then return true end
    if holder_in_the_way(w.k, w.p) then return false end
    for _, h in ipairs(st.h) do
      if h.o == w.o then return true end -- re-entry: let the owner's client come for it
    end
    -- The waiter's own short lease, not the lock's TTL: a waiter that died does not
    -- keep the lock long; a live one renews it to the TTL at once.
    local lease = w.y
    st.t = st.t + 1
    table.insert(st.h, {o = w.o, k = w.k, p = w.p, t = st.t, a = now,
                        d = {{l = w.l, n = w.n, i = w.i, e = now + lease, c = w.c}}})
    remove_waiter(w.l)
    dirty = true
    tell(w.c, w.l .. '=' .. string.format('%d:%d', st.t, lease))
    -- Nobody can join an exclusive holder: no need to look at the next waiter.
    if w.k == 'exclusive' then return false end
  end
  return false
end

-- Wake the waiters that may get in now: the head of the queue, readers right behind a
-- reading head, permit waiters for the free permits.
local function notify()
  if st.q == 0 then return end
  local leases = redis.call('ZRANGE', Q, 0, 63)
  if #leases == 0 then return end
  local head = waiter(leases[1])
  local free = 1
  if head.k == 'permit' then
    free = head.p
    for _, h in ipairs(st.h) do if h.k == 'permit' then free = free - 1 end end
    if free < 1 then free = 1 end
  end
  for i, lease in ipairs(leases) do
    local w = head
    if i > 1 then w = waiter(lease) end
    local take = (i == 1)
      or (head.k == 'shared' and w.k == 'shared')
      or (head.k == 'permit' and w.k == 'permit' and i <= free)
    if not take then break end
    tell(w.c, lease)
  end
end

-- Writes the state back and publishes the messages; those for `own_channel` (the
-- calling client's) are returned instead, for it to deliver without a round trip.
local function save(own_channel)
  if bumped and hand_over() then notify() end
  if dirty then
    redis.call('SET', key, cmsgpack.pack(st))
  end
  local own = ''
  for _, c in ipairs(channels) do
    local text = table.concat(messages[c], ',')
    if c == own_channel then own = text else redis.call('PUBLISH', c, text) end
  end
  return own
end

local function find_hold(lease)
  for hi, h in ipairs(st.h) do
    for di, d in ipairs(h.d) do
      if d.l == lease then return hi, di end
    end
  end
  return nil
end

-- Removes the hold `lease`, and its holder with its last hold. Whether it was held.
local function remove_hold(lease)
  local hi, di = find_hold(lease)
  if not hi then return false end
  table.remove(st.h[hi].d, di)
  if #st.h[hi].d == 0 then table.remove(st.h, hi) end
  return true
end


local function max_expiry(h)
  local e = 0
  for _, d in ipairs(h.d) do if d.e > e then e = d.e end end
  return e
end

local function holder_reply(h)
  if not h then return {'', '', 0, 0, 0, 0, 0, '', 0} end
  local first = h.d[1]
  local left = max_expiry(h) - now
  return {h.o, first.n, first.i, h.t, h.a, left, #h.d, h.k, h.p}
end

prune()
