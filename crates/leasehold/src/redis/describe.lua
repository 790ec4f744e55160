-- Describe. Reply: {server time ms, the state as JSON}.
save()
-- Waiters with their details spelled out. cjson writes an empty list as {}; the client
-- reads either.
for i, w in ipairs(st.w) do
  local d = waiter_details(w)
  d.l, d.k, d.f, d.e = w.l, w.k, w.f, w.e
  st.w[i] = d
end
return {tostring(now), cjson.encode(st)}
