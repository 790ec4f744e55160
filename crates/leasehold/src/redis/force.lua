-- Force-release: drop every holder. Reply: 1 if anyone held it.
local held = H ~= '' and 1 or 0
-- Tell the holders at once, rather than at their next renewal.
for _, h in ipairs(holds()) do
  if h.c ~= '' then tell(h.c, h.l .. '!') end
end
H, he, dirty, bumped = '', 0, true, true
save()
return held
