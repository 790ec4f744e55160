-- Release, fast path, when ours is the only hold (unexpired), waiters are queued and no
-- waiter's lease can have ended (with nobody waiting, hot.lua served it), and nobody
-- watches (watchers are told of a hand-over by save in common.lua).
if only_hold(req_lease) and q > 0 and m > now and not dirty and V == '' then
  -- The head of the queue is a fair writer: hand the lock over, as hand_over in
  -- common.lua would. Its entry must be whole in what was read.
  local head = w0 + skip
  if not (complete or string.find(raw, '\30', head + 1, true)) then whole() end
  local w, after = waiter_in(raw, head)
  if w.f == '1' and w.k == 'exclusive' then
    local entry, message
    entry, he, message = handed(w)
    q = q - 1
    if q == 0 then m = 0 end
    if q > 0 and fixed and #entry == #H and skip + after - head <= 2048 then
      -- The new hold fits where ours was: rewrite the header and the hold in place and
      -- count the head as served, rather than rewriting the whole queue (at most 2 KB
      -- of served waiters stay; the next whole write drops them).
      skip, H = skip + after - head, entry
      redis.call('SETRANGE', key, 0, header() .. H)
    else
      whole()
      H, W = entry, string.sub(raw, after)
      write()
    end
    if w.c == req_channel then return reply.release{released = 1, own = message} end
    redis.call('PUBLISH', w.c, message)
    return 1
  end
end
