-- Renew. ARGV: lease, ttl ms. Reply: 1 renewed, 0 the lease is gone.
local at, after = find_hold(ARGV[1])
if not at then
  save()
  return 0
end
local h = hold_at(at)
h.e = now + ARGV[2]
splice_hold(at, after, pack_hold(h))
save()
return 1
