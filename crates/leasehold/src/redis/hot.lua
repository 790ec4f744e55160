-- The head of every leasehold script. A lock NAME has three keys, one hash tag:
--   KEYS[1] lh:{NAME}        the record (record.lua): holds and queue, when it has any;
--   KEYS[2] lh:{NAME}:hold   an exclusive hold with nobody waiting and no re-entry (a
--                            "hot" hold): LEASE \31 OWNER \31 ACQUIRED MS \31 HOST \31
--                            PID \31 CHANNEL, expiring by Redis's own PX; or MARKER,
--                            without expiry, while the record holds anything;
--   KEYS[3] lh:{NAME}:token  the last fencing token while the record is empty (the record
--                            carries it while in use and puts it back when it empties).
--                            Never deleted, so tokens persist.
-- The invariant: the hold key is MARKER exactly when the record is not empty. So SET NX
-- on the hold key succeeds only when the lock is free and nobody waits, and the
-- commonest calls are served here, as Redis's own commands, without TIME or the record:
--   acquire   free: take it (SET NX PX), the token is INCR of the counter;
--   transfer  hot hold of ARGV[4]: the request takes it over with the next token;
--   release   hot hold of ARGV[1]: delete it; reply 1;
--   renew     hot hold of ARGV[1]: PEXPIRE it; reply 1;
--   held      hot hold of ARGV[1]: reply 1.
-- A grant here replies with the token alone (one hold; a transfer's released hold was
-- held). Anything else goes on to the record (read.lua), which takes a hot hold into the
-- record before it changes anything (record.lua).
--
-- An acquire or transfer comes as few arguments (each one costs the call time): ARGV[1]
-- the hot hold's value as above, ARGV[2] ttl ms, ARGV[3] KIND \31 PERMITS \31 FAIR \31
-- ENQUEUE \31 WAITER LEASE MS \31 FRESH; a transfer adds ARGV[4] the hold it releases
-- and ARGV[5] how long (ms) the request waited in its process (an acquire that waited in
-- its process adds them too, ARGV[4] empty). The code after this file
-- reads them unpacked, by the positions acquire.lua lists.

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

if (HOT == 'acquire' or HOT == 'transfer') and string.sub(ARGV[3], 1, 10) == 'exclusive\31' then
  local taken
  if HOT == 'acquire' then
    taken = redis.call('SET', hold_key, ARGV[1], 'NX', 'PX', ARGV[2])
  else
    taken = hot_of(ARGV[4]) and redis.call('SET', hold_key, ARGV[1], 'PX', ARGV[2])
  end
  if taken then
    local t = redis.call('INCR', token_key)
    if t ~= 1 or HOT ~= 'acquire' then return t end
    -- A new counter: beside an existing record (written before the counter existed),
    -- undo and let the record decide (its last token, its holds); else the name is new,
    -- or Redis lost its data: start from the server's clock (see seed_token).
    if redis.call('EXISTS', key) == 0 then
      t = seed_token()
      redis.call('SET', token_key, t)
      return tonumber(t)
    end
    redis.call('DEL', hold_key, token_key)
  end
elseif HOT == 'release' then
  if hot_of(ARGV[1]) then
    redis.call('DEL', hold_key)
    return 1
  end
elseif HOT == 'renew' then
  if hot_of(ARGV[1]) then
    redis.call('PEXPIRE', hold_key, ARGV[2])
    return 1
  end
elseif HOT == 'held' then
  if hot_of(ARGV[1]) then return 1 end
end

-- The request unpacked, for the code after this file.
local ARGV = ARGV
if HOT == 'acquire' or HOT == 'transfer' then
  local function fields(packed)
    local list = {}
    for field in string.gmatch(packed .. '\31', '([^\31]*)\31') do list[#list + 1] = field end
    return list
  end
  local hold, rest = fields(ARGV[1]), fields(ARGV[3])
  ARGV = {hold[1], hold[2], rest[1], rest[2], ARGV[2], rest[3], rest[4], hold[4], hold[5],
    hold[6], hold[3], rest[5], rest[6], ARGV[4], ARGV[5]}
end
