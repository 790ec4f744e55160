-- Acquire. ARGV: lease, owner, kind (exclusive|shared|permit), permits, ttl ms,
-- fair (0|1), enqueue (0|1), host, pid, client channel, wall clock ms (display only),
-- waiter lease ms (how long a place in the queue lasts unless renewed).
-- Replies: {1, token, holds, released before} when granted;
--   {0, position, retry_in ms, version, holder...} when busy (position 0: not queued,
--   retry_in -1: none; holder: owner, host, pid, token, acquired ms, lease left ms,
--   holds, kind, permits — owner '' when no holder is in the way — then released
--   before: 1 if transfer.lua released a hold first, else 0);
--   an error starting with LHCONFLICT when the request cannot be served as asked.
local lease, owner, kind = ARGV[1], ARGV[2], ARGV[3]
local permits, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local fair, enqueue = ARGV[6] == '1', ARGV[7] == '1'
local host, pid, channel, wall = ARGV[8], tonumber(ARGV[9]), ARGV[10], tonumber(ARGV[11])
local waiter_lease = tonumber(ARGV[12])
local expires = now + ttl

local function granted(h)
  save()
  return {1, h.t, #h.d, released_before}
end

-- A retry of a request already granted: the same answer again.
local hi, di = find_hold(lease)
if hi then
  local d = st.h[hi].d[di]
  if expires > d.e then d.e = expires; dirty = true end
  return granted(st.h[hi])
end

-- Re-entry by the same owner: one more hold, the same token.
for _, h in ipairs(st.h) do
  if h.o == owner then
    if not (h.k == kind or (h.k == 'exclusive' and kind == 'shared')) then
      save()
      return redis.error_reply('LHCONFLICT owner ' .. owner .. ' already holds it as ' .. h.k ..
        ' and asked for ' .. kind .. '; upgrading a shared hold would deadlock, release it first')
    end
    table.insert(h.d, {l = lease, n = host, i = pid, e = expires, c = channel})
    if remove_waiter(lease) then bump() end
    dirty = true
    return granted(h)
  end
end

if kind == 'permit' then
  for _, h in ipairs(st.h) do
    if h.k == 'permit' and h.p ~= permits then
      save()
      return redis.error_reply('LHCONFLICT it is held as a semaphore with ' .. h.p ..
        ' permits; asked with ' .. permits .. '; use the same count everywhere')
    end
  end
end

local blocking_holder = holder_in_the_way(kind, permits)
local me, ahead = false, 0
if st.q > 0 then
  me = redis.call('ZSCORE', Q, lease)
  local before = '+inf'
  if me then before = '(' .. me end
  -- Fair: nobody ahead, except readers let in together. Non-fair: barge, except that a
  -- reader does not pass a waiting writer (no writer starvation).
  if kind == 'shared' then ahead = redis.call('ZCOUNT', X, '-inf', before)
  elseif fair then ahead = redis.call('ZCOUNT', Q, '-inf', before) end
end

if not blocking_holder and ahead == 0 then
  st.t = st.t + 1
  local h = {o = owner, k = kind, p = permits, t = st.t, a = wall,
             d = {{l = lease, n = host, i = pid, e = expires, c = channel}}}
  table.insert(st.h, h)
  remove_waiter(lease)
  dirty = true
  return granted(h)
end

local retry_at = -1
if blocking_holder then
  retry_at = max_expiry(blocking_holder)
else
  local head = redis.call('ZRANGE', Q, 0, 0)[1]
  if head then retry_at = tonumber(redis.call('ZSCORE', E, head)) end
end
local position = 0
if enqueue then
  if me then
    -- Refresh the waiter lease only once a quarter of it is gone.
    if tonumber(redis.call('ZSCORE', E, lease)) < now + waiter_lease * 3 / 4 then
      redis.call('ZADD', E, now + waiter_lease, lease)
      keep_queue()
    end
    position = redis.call('ZRANK', Q, lease) + 1
  else
    st.s = st.s + 1
    dirty = true
    redis.call('ZADD', Q, st.s, lease)
    -- Counted, not added up: the queue's keys may have expired with their waiters.
    st.q = redis.call('ZCARD', Q)
    if kind ~= 'shared' then redis.call('ZADD', X, st.s, lease) end
    redis.call('HSET', W, lease, pack_waiter({k = kind, f = fair and 1 or 0, o = owner,
      p = permits, n = host, i = pid, a = wall, c = channel, x = ttl, y = waiter_lease}))
    redis.call('ZADD', E, now + waiter_lease, lease)
    -- Keep the queue's keys alive while it is in use (a waiter served quickly never
    -- renews its place); topping them up when half their time is gone is enough.
    if st.q == 1 or redis.call('PTTL', Q) < 5000 then keep_queue() end
    position = st.q
  end
end
save()
local reply = {0, position, retry_at - now, st.v}
if retry_at < 0 then reply[3] = -1 end
for _, x in ipairs(holder_reply(blocking_holder)) do reply[#reply + 1] = x end
reply[#reply + 1] = released_before
return reply
