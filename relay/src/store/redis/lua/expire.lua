
local m = redis.call('HMGET', KEYS[1], 'tms', 'dz', 'uz')
local t = m[1]
local gone = 1
if t then
  if t ~= ARGV[1] then
    gone = 0
  else
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
    -- The size lists exist only for logs that reached their cap.
    if m[2] then redis.call('DEL', KEYS[4]) end
    if m[3] then redis.call('DEL', KEYS[5]) end
  end
end
if #KEYS == 5 then return gone end
local removed = redis.call('ZREM', KEYS[6], ARGV[2])
if gone == 1 then
  redis.call('SREM', KEYS[7], ARGV[3])
  redis.call('SREM', KEYS[8], ARGV[3])
  for k = 9, 10 do
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
