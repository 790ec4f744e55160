-- Proclaim: the holder that has the hold req_lease shows req_value from now on (on each
-- of its holds, as they share it). Reply: 1 done, 0 the hold is gone. Watchers are told
-- (save).
local at = find_hold(req_lease)
if not at then
  save()
  return 0
end
local owner = hold_at(at).o
local entries = {}
for _, h in ipairs(holds()) do
  if h.o == owner then h.v = req_value end
  entries[#entries + 1] = pack_hold(h)
end
H, dirty = table.concat(entries), true
save()
return 1
