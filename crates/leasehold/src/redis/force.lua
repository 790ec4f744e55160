-- Force-release: drop every holder. Reply: 1 if anyone held it.
local held = #st.h > 0 and 1 or 0
st.h = {}
bump()
save()
return held
