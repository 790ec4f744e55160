-- Whether a hold exists. req: lease. Reply: 1 held, 0 not.
local held = find_hold(req.lease) and 1 or 0
save()
return held
