-- Renew. ARGV: lease, ttl ms. Reply: 1 renewed, 0 the lease is gone.
local hi, di = find_hold(ARGV[1])
if not hi then
  save()
  return 0
end
st.h[hi].d[di].e = now + tonumber(ARGV[2])
dirty = true
save()
return 1
