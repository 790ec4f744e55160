-- Describe. Reply: reply.state (now: the server's time, ms, as text; state: the lock as
-- JSON: t last token (as text: cjson writes numbers with 14 digits, tokens have up to
-- 16), h holders (o owner, k kind, p permits, t token (text), a acquired ms, v value if
-- any, d holds: {n host, i pid, e expiry ms}), w waiters in queue order (o, k, p, n, i, a since ms)).
-- state.rs reads the JSON.
save()
local holders, by_owner = {}, {}
for _, h in ipairs(holds()) do
  local holder = by_owner[h.o]
  if not holder then
    holder = {o = h.o, k = h.k, p = tonumber(h.p), t = h.t, a = tonumber(h.a), v = h.v, d = {}}
    by_owner[h.o] = holder
    holders[#holders + 1] = holder
  end
  holder.d[#holder.d + 1] = {n = h.n, i = tonumber(h.i), e = tonumber(h.e)}
end
local waiters, s = {}, 1
while s <= #W do
  local w, next = waiter_at(s)
  waiters[#waiters + 1] = {o = w.o, k = w.k, p = tonumber(w.p), n = w.n, i = tonumber(w.i),
                           a = math.floor(arrival_us(w.a) / 1000)}
  s = next
end
-- cjson writes an empty list as {}; the client reads either.
return reply.state{now = tostring(now),
  state = cjson.encode({t = string.format('%d', tonumber(ts)), h = holders, w = waiters})}
