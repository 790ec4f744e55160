-- Release a hold, or leave the queue. ARGV: lease. Reply: 1 a hold was released,
-- 0 nothing was held (a waiter entry is removed all the same).
local lease = ARGV[1]
local released = 0
local hi, di = find_hold(lease)
if hi then
  table.remove(st.h[hi].d, di)
  if #st.h[hi].d == 0 then table.remove(st.h, hi) end
  released = 1
  bump()
end
if remove_waiter(lease) then bump() end
save()
return released
