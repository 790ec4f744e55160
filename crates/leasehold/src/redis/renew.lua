-- Renew. Request: req_lease, req_ttl ms. Reply: 1 renewed, 0 the lease is gone.
local at, after = find_hold(req_lease)
if not at then
  save()
  return 0
end
local h = hold_at(at)
h.e = now + req_ttl
splice_hold(at, after, pack_hold(h))
save()
return 1
