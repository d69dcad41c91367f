
local t = redis.call('HGET', KEYS[1], 'tms')
if not t then return 1 end
if t ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
