
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
if total + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'total', ARGV[2])
redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
return 1
