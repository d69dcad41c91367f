
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local member = ARGV[1] .. '|' .. ARGV[3]
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], member)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), member .. '|left')
return 1
