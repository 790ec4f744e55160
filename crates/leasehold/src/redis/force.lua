-- Force-release: drop every holder. Reply: 1 if anyone held it.
local held = #st.h > 0 and 1 or 0
-- Tell the holders at once, rather than at their next renewal.
for _, h in ipairs(st.h) do
  for _, d in ipairs(h.d) do
    if d.c then tell(d.c, d.l .. '!') end
  end
end
st.h = {}
bump()
save()
return held
