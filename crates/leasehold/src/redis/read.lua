-- After hot.lua: the server's time, and the lock's record (format in record.lua), read
-- once; record.lua parses it.

local clock = redis.call('TIME')
-- Milliseconds since the epoch.
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- Microseconds, for waiters' arrivals: two can come within one ms, and FIFO must tell
-- them apart. (Exact in a double; written with %d, as Lua would write 16 digits as 1e+15.)
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
-- With PREFIX (set by the script before this file), only that many bytes are read at
-- first (header, holds, the head of the queue); whole() reads the rest when needed.
local raw
if PREFIX then
  raw = redis.call('GETRANGE', key, 0, PREFIX - 1)
  if raw == '' then raw = nil end
else
  raw = redis.call('GET', key)
end
local complete = not PREFIX or not raw or #raw < PREFIX
local function whole()
  if not complete then raw, complete = redis.call('GET', key), true end
end
