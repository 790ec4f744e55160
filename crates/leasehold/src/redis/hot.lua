-- Hot paths, taken before the record is parsed: the calls a lock gets most, in the
-- fewest steps (what a script costs Redis is mostly its steps, its calls and the size of
-- its reply). HOT, set by the script: 'acquire', 'transfer' or 'release'. They serve a
-- record that is its header alone (the lock is free) or its header and one unexpired
-- hold, with nobody waiting:
--   acquire   free: the request takes it with the next token;
--   transfer  held by ARGV[14] only: released and taken by the request, as acquire;
--   release   held by ARGV[1] only: free again; reply 1.
-- A grant here replies with the token alone (one hold; a transfer's released hold was
-- held). Anything else goes on to the general code.
if complete then
  local ts, he, hold = '0', '0', ''
  if raw then
    ts, he, hold = string.match(raw,
      '^ *(%d+)\31       0\31            0\31 *(%d+)\31       0\29([^\29]*)\29$')
  end
  -- The lease id whose sole unexpired hold the record is, if it is one.
  local function sole(lease)
    return string.find(hold, '\30' .. lease .. '\31', 1, true) == 1
      and not string.find(hold, '\30', 2, true) and tonumber(he) > now
  end
  if ts and ((HOT == 'acquire' and hold == '') or (HOT == 'transfer' and sole(ARGV[14]))) then
    local t, e = string.format('%d', ts + 1), now + ARGV[5]
    redis.call('SET', key, string.format('%20s\31       0\31            0\31%13d\31       0\29', t, e)
      .. '\30' .. ARGV[1] .. '\31' .. ARGV[2] .. '\31' .. ARGV[3] .. '\31' .. ARGV[4] .. '\31' .. t
      .. '\31' .. ARGV[11] .. '\31' .. ARGV[8] .. '\31' .. ARGV[9] .. '\31' .. e .. '\31' .. ARGV[10]
      .. '\29')
    return tonumber(t)
  end
  if ts and HOT == 'release' and sole(ARGV[1]) then
    redis.call('SET', key, string.format('%20s\31       0\31            0\31            0\31       0\29\29', ts))
    return 1
  end
end
