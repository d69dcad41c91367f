
local t = redis.call('TIME')
local gen = tonumber(t[1]) * 1000000 + tonumber(t[2])
local stored = tonumber(redis.call('HGET', KEYS[1], 'gen') or '0') or 0
local floor = tonumber(ARGV[3]) or 0
if stored + 1 > gen then gen = stored + 1 end
if floor + 1 > gen then gen = floor + 1 end
gen = string.format('%.0f', gen)
redis.call('HSET', KEYS[1], 'gen', gen, 'node', ARGV[1], 'session', ARGV[2], 'inc', ARGV[4])
return gen
