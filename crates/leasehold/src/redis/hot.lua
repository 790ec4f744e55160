-- The head of every leasehold script. A lock NAME has three keys, one hash tag:
--   KEYS[1] lh:{NAME}        the record (record.lua): holds and queue, when it has any;
--   KEYS[2] lh:{NAME}:hold   an exclusive hold with nobody waiting and no re-entry (a
--                            "hot" hold): LEASE \31 OWNER \31 ACQUIRED MS \31 HOST \31
--                            PID \31 CHANNEL, expiring by Redis's own PX; or MARKER
--                            while the record holds anything (it expires a second after
--                            the record: see write() in record.lua);
--   KEYS[3] lh:{NAME}:token  the last fencing token while there is no record (the record
--                            takes it while in use and puts it back when it empties; a
--                            record that ended leaves none, and seed_token starts again).
--                            It expires RECORD_TTL after it was seeded or put back, so a
--                            name used once leaves no key for ever; INCR keeps that
--                            expiry, and seed_token starts again above it (a token is
--                            a grant, and a name cannot have had one a microsecond).
-- The invariant: the hold key is MARKER exactly when the record is not empty (or, for a
-- second, after a record ended: the record's next call clears it). So SET NX
-- on the hold key succeeds only when the lock is free and nobody waits, and the
-- commonest calls are served here, as Redis's own commands, without TIME or the record:
--   acquire   free: take it (SET NX PX), the token is INCR of the counter;
--   transfer  hot hold of req_released: the request takes it over with the next token;
--   release   hot hold of req_lease: delete it; reply 1;
--   renew     hot hold of req_lease: PEXPIRE it; reply 1;
--   held      hot hold of req_lease: reply 1.
-- A grant here replies with the token alone (one hold; a transfer's released hold was
-- held). Anything else goes on to the record (read.lua), which takes a hot hold into the
-- record before it changes anything (record.lua).
--
-- The request's fields are locals req_NAME, named by request.rs (locals, not a table:
-- this runs on every call). An acquire or transfer comes as few arguments (each one
-- costs the call time), and this file reads them as they come: req_hold, the hot hold's
-- value as above (lease, owner, wall, host, pid, channel packed, lease first); req_ttl;
-- req_rest (kind first, then permits, fair, enqueue, waiter_lease, fresh, packed); a
-- transfer's req_released and req_waited (an acquire that waited in its process sends
-- them too, req_released empty). The packed fields are named after this file
-- (req_lease, req_kind, ...). The other calls' arguments are fields of their own.

local key, hold_key, token_key = KEYS[1], KEYS[2], KEYS[3]
local MARKER = '\29'

-- The first token of a name whose counter is missing (a new name, or one that Redis
-- forgot in a restart without persistence): the server's clock in microseconds, so it
-- exceeds every token issued before as long as that clock does not step back. As text
-- (a Lua number would be written as 1.7e+15).
local function seed_token()
  local clock = redis.call('TIME')
  return clock[1] .. string.format('%06d', tonumber(clock[2]))
end

-- Whether the hold key is a hot hold of `lease`.
local function hot_of(lease)
  local value = redis.call('GET', hold_key)
  return value and string.find(value, lease .. '\31', 1, true) == 1
end

-- (A request with a value, an election's, goes to the record: a hot hold has no room for it.)
if (HOT == 'acquire' or HOT == 'transfer') and string.sub(req_rest, 1, 10) == 'exclusive\31'
    and not req_value then
  local taken
  if HOT == 'acquire' then
    taken = redis.call('SET', hold_key, req_hold, 'NX', 'PX', req_ttl)
  else
    taken = hot_of(req_released) and redis.call('SET', hold_key, req_hold, 'PX', req_ttl)
  end
  if taken then
    local t = redis.call('INCR', token_key)
    if t ~= 1 then return t end
    -- A new counter: beside an existing record (written before the counter existed),
    -- undo and let the record decide (its last token, its holds); else the name is new,
    -- its counter expired, or Redis lost its data: start from the server's clock (see
    -- seed_token). (A transfer's hot hold means there is no record.)
    if HOT ~= 'acquire' or redis.call('EXISTS', key) == 0 then
      t = seed_token()
      redis.call('SET', token_key, t, 'PX', RECORD_TTL)
      return tonumber(t)
    end
    redis.call('DEL', hold_key, token_key)
  end
elseif HOT == 'release' then
  if hot_of(req_lease) then
    redis.call('DEL', hold_key)
    return 1
  end
elseif HOT == 'renew' then
  if hot_of(req_lease) then
    redis.call('PEXPIRE', hold_key, req_ttl)
    return 1
  end
elseif HOT == 'held' then
  if hot_of(req_lease) then return 1 end
end
