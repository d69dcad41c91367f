
local m = redis.call('HMGET', KEYS[1], 'term', 'ut', 'us', 'tms', 'callee', 'dl', 'dg', 'ct', 'dt', 'ds', 'acc')
if not m[1] or m[1] == '' or m[2] ~= ARGV[1] or m[3] ~= m[2] or m[5] ~= ARGV[3] then
  return {0}
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl <= 0 then ttl = tonumber(ARGV[4]) end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
-- Written anew, with the digest's bare hex: every value then fits Redis's
-- compact hash encoding (64 bytes by default; `sha256:<hex>` is 71).
redis.call('HSET', KEYS[1], 'callee', m[5], 'dl', m[6] or '0',
  'dg', (string.gsub(m[7] or '', '^sha256:', '')), 'ct', m[8] or '0',
  'dt', m[9] or '0', 'ds', m[10] or '0', 'ut', m[2], 'us', m[3], 'term', m[1],
  'tms', m[4] or '0', 'acc', m[11] or '', 'db', '0', 'ub', '0')
redis.call('PEXPIRE', KEYS[1], ttl)
if #KEYS == 8 then
  redis.call('SREM', KEYS[6], ARGV[2])
  redis.call('SREM', KEYS[7], ARGV[2])
  redis.call('ZREM', KEYS[8], string.rep('0', 20 - #m[4]) .. m[4] .. '|' .. ARGV[2] .. '|' .. m[5])
  return {1, m[4], 1}
end
return {1, m[4], 0}
