
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_end = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], lease_end, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
local prefix = ARGV[1] .. '|'
local mine = prefix .. ARGV[3]
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if m ~= mine and string.sub(m, 1, #prefix) == prefix
     and not string.find(m, '|', #prefix + 1, true) then
    redis.call('ZREM', KEYS[2], m)
  end
end
redis.call('ZADD', KEYS[2], lease_end, mine)
return {redis.call('ZRANGE', KEYS[1], 0, -1), redis.call('ZRANGE', KEYS[2], 0, -1)}
