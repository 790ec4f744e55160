-- Describe. Reply: {server time ms, the state as JSON, with its waiters in queue order}.
save()
local waiters = {}
local queue = {}
if st.q > 0 then queue = redis.call('ZRANGE', Q, 0, -1) end
for i, lease in ipairs(queue) do
  local w = waiter(lease)
  w.e = tonumber(redis.call('ZSCORE', E, lease))
  waiters[i] = w
end
st.w = waiters
-- cjson writes an empty list as {}; the client reads either.
return {tostring(now), cjson.encode(st)}
