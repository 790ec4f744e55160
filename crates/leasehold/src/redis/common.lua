-- Shared head of every leasehold script: one lock's whole state in one key, so every
-- check-and-change is one script on one key (cluster-safe: the key is KEYS[1]).
--
-- KEYS[1]: the lock's key, lh:{NAME}. Its value (MessagePack, compact and quick to
-- read and write; describe.lua gives it as JSON):
--   t  last fencing token (never decreases; the key is never deleted, so tokens persist)
--   v  version: bumped when a hold or a waiter goes away (what waiters wait for)
--   s  next waiter sequence number (queue order)
--   h  holders: {o owner, k kind, p permits, t token, a acquired ms, d holds:
--        {l lease, n host, i pid, e expiry ms, c client channel}}
--   w  waiters in queue order: {l lease, k kind, f fair, e expiry ms, d details}; the
--        fields every call looks at are fields, the rest is one string (fewer fields
--        make a long queue quicker to read and write): see waiter_details.
-- Expiry times are the server's (TIME), in ms; clients' clocks are never used for them
-- (a holder's "acquired" time is the client's wall clock, for display only).

local key = KEYS[1]
local clock = redis.call('TIME')
-- Milliseconds since the epoch.
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local raw = redis.call('GET', key)
local st
if raw then st = cmsgpack.unpack(raw) else st = {t = 0, v = 0, s = 0, h = {}, w = {}} end
local dirty = false
local bumped = false
-- Set by transfer.lua when the hold it hands over was still held; ends acquire replies.
local released_before = 0

local function bump()
  st.v = st.v + 1
  dirty = true
  bumped = true
end

-- Drop expired holds, holders without holds, expired waiters (tables are rebuilt only
-- when something expired: this runs on every call).
local function expired_any()
  for _, h in ipairs(st.h) do
    for _, d in ipairs(h.d) do if d.e <= now then return true end end
  end
  for _, w in ipairs(st.w) do if w.e <= now then return true end end
  return false
end

local function prune()
  if not expired_any() then return end
  local holders = {}
  for _, h in ipairs(st.h) do
    local holds = {}
    for _, d in ipairs(h.d) do
      if d.e > now then holds[#holds + 1] = d end
    end
    h.d = holds
    if #holds > 0 then holders[#holders + 1] = h end
  end
  local waiters = {}
  for _, w in ipairs(st.w) do
    if w.e > now then waiters[#waiters + 1] = w end
  end
  st.h, st.w = holders, waiters
  bump()
end

-- A waiter's details: o owner, p permits, n host, i pid, a since ms, c client channel,
-- x lease ttl ms, y waiter lease ms (at most x).
local DETAILS = {'o', 'p', 'n', 'i', 'a', 'c', 'x', 'y'}
local NUMERIC = {p = true, i = true, a = true, x = true, y = true}

local function waiter_details(w)
  local out, i, n = {}, 1, 1
  local s = w.d
  while n <= #DETAILS do
    local j = string.find(s, '\31', i, true)
    local field = string.sub(s, i, (j or 0) - 1)
    local name = DETAILS[n]
    if NUMERIC[name] then out[name] = tonumber(field) else out[name] = field end
    if not j then break end
    i, n = j + 1, n + 1
  end
  return out
end

local function pack_details(t)
  local parts = {}
  for n, name in ipairs(DETAILS) do parts[n] = tostring(t[name]) end
  return table.concat(parts, '\31')
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
  while #st.w > 0 do
    local w = st.w[1]
    if w.f ~= 1 then return true end
    local d = waiter_details(w)
    if holder_in_the_way(w.k, d.p) then return false end
    for _, h in ipairs(st.h) do
      if h.o == d.o then return true end -- re-entry: let the owner's client come for it
    end
    -- The waiter's own short lease, not the lock's TTL: a waiter that died does not
    -- keep the lock long; a live one renews it to the TTL at once.
    local lease = d.y
    st.t = st.t + 1
    table.insert(st.h, {o = d.o, k = w.k, p = d.p, t = st.t, a = now,
                        d = {{l = w.l, n = d.n, i = d.i, e = now + lease, c = d.c}}})
    table.remove(st.w, 1)
    dirty = true
    tell(d.c, w.l .. '=' .. string.format('%d:%d', st.t, lease))
  end
  return false
end

-- Wake the waiters that may get in now: the head of the queue, readers right behind a
-- reading head, permit waiters for the free permits.
local function notify()
  if #st.w == 0 then return end
  local head = st.w[1]
  local free = 1
  if head.k == 'permit' then
    free = waiter_details(head).p
    for _, h in ipairs(st.h) do if h.k == 'permit' then free = free - 1 end end
    if free < 1 then free = 1 end
  end
  for i, w in ipairs(st.w) do
    local take = (i == 1)
      or (head.k == 'shared' and w.k == 'shared')
      or (head.k == 'permit' and w.k == 'permit' and i <= free)
    if not take then break end
    tell(waiter_details(w).c, w.l)
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

local function remove_waiter(lease)
  for i, w in ipairs(st.w) do
    if w.l == lease then
      table.remove(st.w, i)
      return true
    end
  end
  return false
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
