-- Downgrade: the holder that has the hold req_lease holds it shared from now on, with
-- the same token (the lock rules' rule 5, rules::downgrade). Reply: 1 done (or shared
-- already: a downgrade sent again), 0 the hold is gone, or {kind, permits, holds, owner}
-- when the rules refuse it (another kind, or more holds of its owner), for Rust to say
-- why. Readers waiting for the writer are handed the lock or woken (save).
local at = find_hold(req_lease)
if not at then
  save()
  return 0
end
local h, next = hold_at(at)
local count = holds_of(h.o)
if h.k ~= 'shared' then
  if h.k ~= 'exclusive' or count > 1 then
    save()
    return {h.k, h.p, count, h.o}
  end
  h.k = 'shared'
  splice_hold(at, next, pack_hold(h))
  bumped = true
end
save()
return 1
