-- Whether a hold exists. ARGV: lease. Reply: 1 held, 0 not.
local held = find_hold(ARGV[1]) and 1 or 0
save()
return held
