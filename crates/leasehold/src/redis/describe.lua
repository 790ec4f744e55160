-- Describe. Reply: {server time ms, the state as JSON}.
save()
return {tostring(now), cjson.encode(st)}
