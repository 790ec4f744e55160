-- Transfer, fast path: the hold handed over (ARGV[14]) is the only one and nobody waits
-- in the store: release it here; acquire_fast.lua, next, takes the lock for the request.
if q == 0 and only_hold(ARGV[14]) then
  H, he, released_before, dirty = '', 0, 1, true
end
