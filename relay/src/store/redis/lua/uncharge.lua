
local held = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local back = held
if ARGV[2] ~= '' then back = math.min(held, tonumber(ARGV[2])) end
if back > 0 then
  redis.call('HINCRBY', KEYS[1], 'total', string.format('%.0f', -back))
end
if held - back <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HINCRBY', KEYS[1], ARGV[1], string.format('%.0f', -back))
end
if tonumber(redis.call('HGET', KEYS[1], 'total') or '0') <= 0 then
  redis.call('DEL', KEYS[1])
end
return 1
