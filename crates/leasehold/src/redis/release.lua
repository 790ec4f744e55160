-- Release a hold, or leave the queue. Request: req_lease, req_channel (the caller's).
-- Reply: 1 if a hold was released (0 if nothing was held; a waiter entry is removed all
-- the same), or, when some of the caller's own waiters are to be told (as others are
-- published to), reply.release (released: that, own: the messages).
local lease = req_lease
local released = 0
-- A lease is a hold or a place in the queue, never both.
if remove_hold(lease) then
  released = 1
  bumped = true
elseif remove_waiter(lease) then
  bumped = true
end
local own = save(req_channel)
if own == '' then return released end
return reply.release{released = released, own = own}
