-- Release, fast paths, when ours is the only hold (unexpired) and no waiter's lease can
-- have ended.
if only_hold(ARGV[1]) and (q == 0 or m > now) and not dirty then
  if q == 0 then
    H, he = '', 0
    write()
    return {1, ''}
  end
  -- The head of the queue is a fair writer: hand the lock over (as hand_over in
  -- common.lua would), rewriting the record around the rest of the queue as it is.
  local w, after = waiter_in(raw, w0)
  if w.f == '1' and w.k == 'exclusive' then
    local message
    H, he, message = handed(w)
    q = q - 1
    if q == 0 then m = 0 end
    redis.call('SET', key, header() .. H .. '\29' .. string.sub(raw, after))
    if w.c == ARGV[2] then return {1, message} end
    redis.call('PUBLISH', w.c, message)
    return {1, ''}
  end
end
