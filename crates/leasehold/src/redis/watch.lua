-- Watch: notes the watcher req_id, whose client listens on req_channel, until req_ttl ms
-- from now (refreshing its entry; req_ttl 0 removes it), then describes the lock as
-- describe.lua (which follows this file) does, in the same step: so a change after this
-- look is published to it. While the entry lasts, every script that changes the holders
-- (owner, token, value) publishes req_id to req_channel (save in common.lua).
local entry = '\30' .. req_id .. '\31'
local s = string.find(V, entry, 1, true)
if s then
  V = string.sub(V, 1, s - 1) .. string.sub(V, string.find(V, '\30', s + 1, true) or #V + 1)
  dirty = true
end
if req_ttl ~= '0' then
  V = V .. entry .. req_channel .. '\31' .. string.format('%d', now + tonumber(req_ttl))
  dirty = true
end
