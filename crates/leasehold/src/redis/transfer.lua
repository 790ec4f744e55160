-- Transfer: release the hold req_released, then acquire exactly as acquire.lua (which
-- this file is followed by) in the same step. How a client hands a lock from one of its
-- tasks to the next in one round trip. The replies of acquire.lua say released = 1 if
-- req_released was held (0 if not).
if remove_hold(req_released) then
  released_before = 1
  bumped = true
end
