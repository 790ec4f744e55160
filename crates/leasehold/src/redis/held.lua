-- Whether a hold exists. Request: req_lease. Reply: 1 held, 0 not.
local held = find_hold(req_lease) and 1 or 0
save()
return held
