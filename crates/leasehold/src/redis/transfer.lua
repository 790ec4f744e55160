-- Transfer: release the hold ARGV[14], then acquire exactly as acquire.lua (which this
-- file is followed by) in the same step. How a client hands a lock from one of its tasks
-- to the next in one round trip. The replies of acquire.lua end with 1 if ARGV[14] was
-- held (0 if not).
if remove_hold(ARGV[14]) then
  released_before = 1
  bumped = true
end
