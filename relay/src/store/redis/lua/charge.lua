
local sum = 0
for i = 2, #ARGV, 2 do sum = sum + tonumber(ARGV[i + 1]) end
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
if total + sum > tonumber(ARGV[1]) then return 0 end
redis.call('HINCRBY', KEYS[1], 'total', string.format('%.0f', sum))
for i = 2, #ARGV, 2 do redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
