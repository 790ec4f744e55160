-- Release a hold, or leave the queue. ARGV: lease. Reply: 1 a hold was released,
-- 0 nothing was held (a waiter entry is removed all the same).
local lease = ARGV[1]
local released = 0
if remove_hold(lease) then
  released = 1
  bump()
end
if remove_waiter(lease) then bump() end
save()
return released
