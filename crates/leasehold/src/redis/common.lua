-- The general code of every script, after record.lua (and a fast path): the functions
-- that find, change and hand over holds and waiters, then the pruning of expired ones.

if q > 0 then
  whole()
  W = string.sub(raw, w0 + skip)
end

-- Every hold, parsed (once for each value of H).
local parsed_H, parsed = '', {}
local function holds()
  if parsed_H ~= H then
    parsed, parsed_H = {}, H
    local i = 1
    while i <= #H do
      parsed[#parsed + 1], i = hold_at(i)
    end
  end
  return parsed
end

-- Adds a hold (its packed entry) expiring at `e`.
local function add_hold(entry, e)
  if H == '' or e < he then he = e end
  H = H .. entry
  dirty = true
end

-- Where the hold `lease` starts in H, and where the next one does; nil if not held.
local function find_hold(lease)
  if H == '' then return nil end
  local s = string.find(H, '\30' .. lease .. '\31', 1, true)
  if not s then return nil end
  return s, string.find(H, '\30', s + 1, true) or #H + 1
end

-- Replaces the hold from `s` to before `next` with the entry `entry` ('' removes it).
local function splice_hold(s, next, entry)
  H = string.sub(H, 1, s - 1) .. entry .. string.sub(H, next)
  if H == '' then he = 0 end
  dirty = true
end

-- Removes the hold `lease`. Whether it was held.
local function remove_hold(lease)
  local s, next = find_hold(lease)
  if not s then return false end
  splice_hold(s, next, '')
  return true
end

-- How many holds `owner` has, and when the last of them expires.
local function holds_of(owner)
  local count, last = 0, 0
  for _, h in ipairs(holds()) do
    if h.o == owner then
      count = count + 1
      last = math.max(last, tonumber(h.e))
    end
  end
  return count, last
end

-- The waiter whose entry starts at `s` in W (the head's at 1), and where the next starts.
local function waiter_at(s)
  return waiter_in(W, s)
end

-- Where the waiter `lease` starts in W, or nil.
local function find_waiter(lease)
  if q == 0 then return nil end
  return (string.find(W, '\30' .. lease .. '\31', 1, true))
end

local function remove_waiter(lease)
  local s = find_waiter(lease)
  if not s then return false end
  W = string.sub(W, 1, s - 1) .. string.sub(W, string.find(W, '\30', s + 1, true) or #W + 1)
  q = q - 1
  if q == 0 then m = 0 end
  dirty = true
  return true
end

-- The holders as a watcher compares them (LockState::same_holders): owner, token and
-- value of each, in order.
local function holders_seen()
  local seen, owners = {}, {}
  for _, h in ipairs(holds()) do
    if not owners[h.o] then
      owners[h.o] = true
      seen[#seen + 1] = h.o .. '\31' .. h.t .. '\31' .. (h.v and ('=' .. h.v) or '')
    end
  end
  return table.concat(seen, '\30')
end

-- holders_seen() before this script changed anything, when anyone watches (else nil).
local watched

-- Drop expired holds, waiters and watchers, when one can have expired.
local function prune()
  if H ~= '' and he <= now then
    local kept, first = {}, 0
    for _, h in ipairs(holds()) do
      local e = tonumber(h.e)
      if e > now then
        kept[#kept + 1] = pack_hold(h)
        if first == 0 or e < first then first = e end
      end
    end
    if #kept < #parsed then
      H = table.concat(kept)
      bumped = true
    end
    he, dirty = first, true
  end
  if q > 0 and m <= now then
    local alive, s, first = {}, 1, 0
    while s <= #W do
      local w, next = waiter_at(s)
      local e = tonumber(w.e)
      if e > now then
        alive[#alive + 1] = string.sub(W, s, next - 1)
        if first == 0 or e < first then first = e end
      end
      s = next
    end
    if #alive < q then
      q, W = #alive, table.concat(alive)
      bumped = true
    end
    m, dirty = first, true
  end
  if V ~= '' then
    local alive = {}
    for entry, e in string.gmatch(V, '(\30[^\31]*\31[^\31]*\31(%d+))') do
      if tonumber(e) > now then alive[#alive + 1] = entry end
    end
    local kept = table.concat(alive)
    if kept ~= V then V, dirty = kept, true end
  end
end

-- The first hold of a holder that a new `kind` holder could not stand beside, if any.
local function holder_in_the_way(kind, permits)
  if H == '' then return nil end
  if kind == 'exclusive' then return (hold_at(1)) end
  local owners, count = {}, 0
  for _, h in ipairs(holds()) do
    local compatible = (h.k == 'shared' and kind == 'shared') or (h.k == 'permit' and kind == 'permit')
    if not compatible then return h end
    if not owners[h.o] then owners[h.o], count = true, count + 1 end
  end
  if kind == 'permit' and count >= permits then return parsed[1] end
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
-- trip to come and take it, and nobody can pass them. The hold lasts what is left of the
-- waiter's lease (its client counts it from its last request, which is earlier, and
-- renews to the full TTL at once), so a waiter that died does not keep the lock longer
-- than its place would have lasted.
-- Returns whether the head should still be woken: a non-fair head, or one that must
-- come itself (re-entry); not a fair head that a holder keeps out.
local function hand_over()
  while q > 0 do
    local w, next = waiter_at(1)
    if w.f ~= '1' then return true end
    if holder_in_the_way(w.k, tonumber(w.p)) then return false end
    if H ~= '' and holds_of(w.o) > 0 then return true end -- re-entry: the owner's client comes
    local entry, e, message = handed(w)
    add_hold(entry, e)
    W, q = string.sub(W, next), q - 1
    if q == 0 then m = 0 end
    tell(w.c, message)
    -- Nobody can join an exclusive holder: no need to look at the next waiter.
    if w.k == 'exclusive' then return false end
  end
  return false
end

-- Wake the waiters that may get in now: the head of the queue, readers right behind a
-- reading head, permit waiters for the free permits (at most 64 in all). Any non-fair
-- writer may take a free lock, and one woken is enough; but the head may have died (its
-- place lasts until its waiter lease ends), so the non-fair writer whose place was
-- renewed last, the likeliest to be alive, is woken too.
local function notify()
  if q == 0 then return end
  local head, s = waiter_at(1)
  tell(head.c, head.l)
  local free = 1
  if head.k == 'exclusive' and head.f ~= '1' then
    local last, e = nil, tonumber(head.e)
    for _ = 2, 64 do
      if s > #W then break end
      local w, next = waiter_at(s)
      if w.k == 'exclusive' and w.f ~= '1' and tonumber(w.e) > e then last, e = w, tonumber(w.e) end
      s = next
    end
    if last then tell(last.c, last.l) end
    return
  end
  if head.k == 'permit' then
    local owners, count = {}, 0
    for _, h in ipairs(holds()) do
      if h.k == 'permit' and not owners[h.o] then owners[h.o], count = true, count + 1 end
    end
    free = tonumber(head.p) - count
  elseif head.k ~= 'shared' then
    return
  end
  for i = 2, 64 do
    if s > #W then return end
    local w, next = waiter_at(s)
    local take = (head.k == 'shared' and w.k == 'shared')
      or (head.k == 'permit' and w.k == 'permit' and i <= free)
    if not take then return end
    tell(w.c, w.l)
    s = next
  end
end

-- Writes the record back and publishes the messages; those for `own_channel` (the
-- calling client's) are returned instead, for it to deliver without a round trip.
local function save(own_channel)
  if bumped and hand_over() then notify() end
  if watched and V ~= '' and holders_seen() ~= watched then
    for id, c in string.gmatch(V, '\30([^\31]*)\31([^\31]*)\31') do tell(c, id) end
  end
  if dirty then write() end
  local own = ''
  for _, c in ipairs(channels) do
    local text = table.concat(messages[c], ',')
    if c == own_channel then own = text else redis.call('PUBLISH', c, text) end
  end
  return own
end

-- The holder whose first hold is `h` (as holder_in_the_way finds it), as reply.busy
-- gives it: owner '' when there is none.
local function holder_reply(h)
  if not h then
    return {owner = '', host = '', pid = 0, token = 0, acquired = 0, lease_left = 0, holds = 0,
            kind = '', permits = 0, value = false}
  end
  local count, last = holds_of(h.o)
  return {owner = h.o, host = h.n, pid = h.i, token = h.t, acquired = h.a, lease_left = last - now,
          holds = count, kind = h.k, permits = h.p, value = h.v or false}
end

if V ~= '' then watched = holders_seen() end
prune()
