
if redis.call('EXISTS', KEYS[1]) == 1 then
  local out = redis.call('HGETALL', KEYS[1])
  table.insert(out, 1, 'E')
  return out
end
redis.call('DEL', KEYS[2], KEYS[3])
local meta = {'callee', ARGV[1], 'dl', ARGV[2], 'dg', ARGV[3], 'ct', ARGV[4],
  'dt', '1', 'ds', '1', 'ut', '0', 'us', '0', 'term', '', 'tms', '', 'acc', '',
  'db', string.format('%.0f', #ARGV[5]), 'ub', '0'}
if ARGV[8] ~= '' then
  meta[#meta + 1] = 'tr'
  meta[#meta + 1] = ARGV[8]
end
redis.call('HSET', KEYS[1], unpack(meta))
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[6], '1-0', 'f', ARGV[5])
if ARGV[7] ~= '' then redis.call('PUBLISH', ARGV[7], 'W' .. ARGV[5]) end
if #KEYS == 8 then
  redis.call('SADD', KEYS[4], ARGV[9])
  redis.call('SADD', KEYS[5], ARGV[9])
  redis.call('SADD', KEYS[6], ARGV[9])
  redis.call('SADD', KEYS[7], ARGV[9])
  redis.call('ZADD', KEYS[8], 0, ARGV[10])
end
return {'N'}
