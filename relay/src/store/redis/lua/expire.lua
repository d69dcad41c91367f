
local t = redis.call('HGET', KEYS[1], 'tms')
local gone = 1
if t then
  if t ~= ARGV[1] then gone = 0 else redis.call('DEL', KEYS[1], KEYS[2], KEYS[3]) end
end
if #KEYS == 3 then return gone end
local removed = redis.call('ZREM', KEYS[4], ARGV[2])
if gone == 1 then
  redis.call('SREM', KEYS[5], ARGV[3])
  redis.call('SREM', KEYS[6], ARGV[3])
  for k = 7, 8 do
    local v = redis.call('HMGET', KEYS[k], ARGV[3], 'total')
    local held = tonumber(v[1] or '0')
    local total = tonumber(v[2] or '0')
    if total - held <= 0 then
      redis.call('DEL', KEYS[k])
    elseif v[1] then
      redis.call('HDEL', KEYS[k], ARGV[3])
      redis.call('HSET', KEYS[k], 'total', string.format('%.0f', total - held))
    end
  end
end
return {gone, removed}
