-- Describe. Reply: {server time ms, the state as JSON}.
save()
-- cjson writes an empty list as {}; the client reads either.
return {tostring(now), cjson.encode(st)}
