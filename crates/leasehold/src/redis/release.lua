-- Release a hold, or leave the queue. ARGV: lease, the caller's channel. Reply: 1 if a
-- hold was released (0 if nothing was held; a waiter entry is removed all the same),
-- or, when some of the caller's own waiters are to be told (as others are published
-- to), {that, the messages}.
local lease = ARGV[1]
local released = 0
-- A lease is a hold or a place in the queue, never both.
if remove_hold(lease) then
  released = 1
  bumped = true
elseif remove_waiter(lease) then
  bumped = true
end
local own = save(ARGV[2])
if own == '' then return released end
return {released, own}
