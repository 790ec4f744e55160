-- The lock's record, parsed, and what every script does with it. The record, KEYS[1] =
-- lh:{NAME}, is a string holding the lock's holds and its queue, so a script reads it
-- once (GET, or GETRANGE of its start) and writes it once (SET, or SETRANGE and APPEND
-- of the parts it changes), one atomic step in one cluster slot. It exists only while
-- it holds anything; a free lock is its token counter, and an exclusive hold with
-- nobody waiting is the hold key alone (see hot.lua, and "What the hold key holds" below).
--
-- The record: HEADER \29 HOLDS \29 WAITERS. Fields are separated by \31 (owner ids hold
-- no control characters; the client replaces \29-\31 in the other strings); each hold
-- and each waiter starts with \30.
--   HEADER  t last fencing token (never decreases; while the record exists it has the
--           last token, and it gives it back to the counter key when it goes), q waiters
--           queued, m and he: no waiter lease (m) or hold (he) ends before this, in ms
--           (lower bounds, 0 when there is none: expired entries are looked for only
--           when one can be), skip: how many bytes at the start of WAITERS are waiters
--           already served (see release_fast.lua); then V, the watchers (watch.lua),
--           usually none: each \30 id \31 client channel \31 expiry ms. A watcher keeps
--           the record (so the hold key is MARKER and every call comes to the record,
--           which tells the watchers when the holders change: save in common.lua).
--   hold    l lease, o owner, k kind, p permits, t token, a acquired ms (the client's
--           wall clock, for display only), n host, i pid, e expiry ms, c client channel,
--           and v the holder's value only if it has one (an election's: \31 v). A
--           holder is the holds of one owner (more than one after re-entry), which
--           share its kind, permits, token, acquired time and value.
--   waiter  l lease, k kind, f fair (0|1), o owner, p permits, n host, i pid, a arrived
--           µs (server time; earlier than its request for a task that first waited in
--           its process; ms in records of older versions: see arrival_us), c client channel, x lease ttl ms, y waiter lease ms, e waiter
--           lease expiry ms, and v the value it will hold with, if any (\31 v). In
--           arrival order, the head first.
-- Every call and step costs in Redis's Lua, a string-to-number conversion or a format as
-- much as a dozen steps: so holds and waiters stay strings, found by their lease, and a
-- script parses only the entries it needs (one pattern match each), keeps fields as
-- strings and converts only the numbers it computes with.
-- Expiry times are the server's (TIME), in ms; clients' clocks are never used for them.

-- A waiter's arrival in µs; older versions wrote ms (under 1e14, which in µs is 1973).
local function arrival_us(a)
  a = tonumber(a)
  if a < 1e14 then return a * 1000 end
  return a
end

local function pack_hold(h)
  return '\30' .. h.l .. '\31' .. h.o .. '\31' .. h.k .. '\31' .. h.p .. '\31' .. h.t .. '\31' ..
    h.a .. '\31' .. h.n .. '\31' .. h.i .. '\31' .. h.e .. '\31' .. h.c .. (h.v and '\31' .. h.v or '')
end

local function pack_waiter(w)
  return '\30' .. w.l .. '\31' .. w.k .. '\31' .. w.f .. '\31' .. w.o .. '\31' .. w.p .. '\31' ..
    w.n .. '\31' .. w.i .. '\31' .. w.a .. '\31' .. w.c .. '\31' .. w.x .. '\31' .. w.y .. '\31' .. w.e ..
    (w.v and '\31' .. w.v or '')
end

-- An entry's last field as matched, split from the value after it (nil: none), which
-- pack_hold and pack_waiter write only when there is one.
local function unpack_value(last)
  local s = last and string.find(last, '\31', 1, true)
  if not s then return last, nil end
  return string.sub(last, 1, s - 1), string.sub(last, s + 1)
end

-- ts: the last token, as written; the other header fields as numbers. W, the queue, is
-- taken out of `raw` (from `w0`, after `skip` bytes of waiters already served) by
-- common.lua: a fast path has no need to, and every new string costs Lua a pass over
-- all its bytes (hashing), which counts for a queue.
local ts, q, m, he, skip, H, W, w0, V = '0', 0, 0, 0, 0, '', '', 1, ''
local dirty = false
-- Whether the header read has the fixed width that header() writes.
local fixed = false
if raw then
  local qs, ms, hs, ks, i
  local header_pattern = '^ *(%d+)\31 *(%d+)\31 *(%d+)\31 *(%d+)\31 *(%d+)([^\29]*)\29()'
  ts, qs, ms, hs, ks, V, i = string.match(raw, header_pattern)
  if not ts and not complete then
    -- Watchers past the part read at first.
    whole()
    ts, qs, ms, hs, ks, V, i = string.match(raw, header_pattern)
  end
  if ts then
    local j = string.find(raw, '\29', i, true)
    if not j then
      whole()
      j = string.find(raw, '\29', i, true)
    end
    H, w0, q, fixed = string.sub(raw, i, j - 1), j + 1, tonumber(qs), i == 68
    if q > 0 then m, skip = tonumber(ms), tonumber(ks) end
    if H ~= '' then he = tonumber(hs) end
  else
    -- A record of the earlier MessagePack format: keep its token and holds.
    V = ''
    whole()
    local old = cmsgpack.unpack(raw)
    ts, dirty = string.format('%d', old.t), true
    for _, h in ipairs(old.h) do
      for _, d in ipairs(h.d) do
        H = H .. pack_hold({l = d.l, o = h.o, k = h.k, p = h.p, t = string.format('%d', h.t),
                            a = h.a, n = d.n, i = d.i, e = d.e, c = d.c or ''})
        if he == 0 or d.e < he then he = d.e end
      end
    end
  end
end
-- What the hold key holds: MARKER while the record is not empty (so it is not read
-- then). With an empty record it may be a hot hold: taken into H here, as a hold like
-- any other, and the record and MARKER are written only if the script writes (so a
-- look at a hot hold leaves it hot). The counter has the last token then.
local hold_value = MARKER
if H == '' and q == 0 and V == '' then
  local got = redis.call('MGET', hold_key, token_key)
  hold_value = got[1]
  if got[2] and tonumber(got[2]) > tonumber(ts) then ts = got[2] end
  if hold_value and hold_value ~= MARKER then
    read_hot_hold(hold_value)
    he = now + redis.call('PTTL', hold_key)
    H = pack_hold({l = hot_lease, o = hot_owner, k = 'exclusive', p = '0', t = ts, a = hot_wall,
                   n = hot_host, i = hot_pid, e = he, c = hot_channel})
    -- Not as stored: the fast paths, which change the stored record in place, stay off.
    fixed = false
  end
end

-- A hold or a waiter went away: the queue may move.
local bumped = false
-- Set by transfer when the hold it hands over was still held; ends acquire replies.
local released_before = 0

-- The header, of fixed width while nobody watches (so that a waiter can be queued by
-- rewriting only it and appending its entry: see acquire_fast.lua).
local function header()
  return string.format('%20s\31%8s\31%13s\31%13s\31%8s', ts, q, m, he, skip) .. V .. '\29'
end

-- Writes the whole record (W, the queue, without the waiters already served), and keeps
-- the hold key to it: MARKER while the record holds anything (a watcher too). An empty
-- record goes, with the hold key, and gives its last token back to the counter.
--
-- Neither outlives its last whole write by more than RECORD_TTL (twice the longest
-- lease; what is in it renews by whole writes, holds within a third of their lease and
-- waiters within theirs), so the record of clients that all died ends by itself. MARKER
-- outlives the record by a second: a record that ends first leaves an empty record
-- beside MARKER, which the next call serves here and clears, never a hot hold beside a
-- record. The record takes the token from the counter, which goes meanwhile: a record
-- that ends (or that Redis lost) leaves the next token to be seeded from the clock
-- (seed_token in hot.lua), never counted on from an older one.
local function write()
  skip = 0
  if H == '' and q == 0 and V == '' then
    redis.call('DEL', key, hold_key)
    -- (A name that never had a token, a force-release of an unused name, leaves none.)
    if tonumber(ts) > 0 then redis.call('SET', token_key, ts, 'PX', RECORD_TTL) end
    hold_value = false
  else
    redis.call('SET', key, header() .. H .. '\29' .. W, 'PX', RECORD_TTL)
    if hold_value ~= MARKER then
      redis.call('SET', hold_key, MARKER, 'PX', RECORD_TTL + 1000)
      redis.call('DEL', token_key)
      hold_value = MARKER
    else
      redis.call('PEXPIRE', hold_key, RECORD_TTL + 1000)
    end
  end
end

-- Whether the only hold is `lease`, unexpired: the common case that the fast paths
-- (*_fast.lua) serve before the general code (common.lua) is even defined.
local function only_hold(lease)
  return he > now and string.find(H, '\30' .. lease .. '\31', 1, true) == 1
    and not string.find(H, '\30', 2, true)
end

-- A new fencing token: the next, or the first of a name that never had one (new, or
-- forgotten by Redis: see seed_token in hot.lua).
local function next_token()
  if tonumber(ts) == 0 then
    ts = seed_token()
  else
    ts = string.format('%d', tonumber(ts) + 1)
  end
  return ts
end

-- The hold whose entry starts at `i` in H: its fields (strings), and where the next
-- entry starts.
local function hold_at(i)
  local l, o, k, p, t, a, n, pid, e, c, next = string.match(H,
    '^\30([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\30]*)()', i)
  local c, v = unpack_value(c)
  return {l = l, o = o, k = k, p = p, t = t, a = a, n = n, i = pid, e = e, c = c, v = v}, next
end

-- The waiter whose entry starts at `s` in `str`: its fields (strings), and where the
-- next entry starts.
local function waiter_in(str, s)
  local l, k, f, o, p, n, pid, a, c, x, y, e, next = string.match(str,
    '^\30([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\30\29]*)()', s)
  local e, v = unpack_value(e)
  return {l = l, k = k, f = f, o = o, p = p, n = n, i = pid, a = a, c = c, x = x, y = y,
          e = e, v = v}, next
end

-- Hands the lock to the fair waiter `w`: a new token and a hold that lasts what is left
-- of the waiter's own lease (see hand_over in common.lua), so a waiter that died keeps
-- the lock no longer than its place would have lasted. Its entry, its expiry, and the
-- message (the hold's ms left).
local function handed(w)
  local t, e = next_token(), tonumber(w.e)
  return pack_hold({l = w.l, o = w.o, k = w.k, p = w.p, t = t, a = now, n = w.n, i = w.i,
                    e = e, c = w.c, v = w.v}), e, w.l .. '=' .. t .. ':' .. (e - now)
end
