
local m = redis.call('HMGET', KEYS[1], ARGV[1]..'t', ARGV[1]..'s', 'term', 'acc', 'dl', 'callee')
if not m[1] then return {'U'} end
local seq = tonumber(ARGV[2])
local tail = tonumber(m[1])
local cur = m[3] or ''
local term = ARGV[4]
if ARGV[3] == 'r' then
  if seq ~= tail + 1 then return {'C', m[1]} end
  if term ~= '' and cur ~= '' then return {'T', cur} end
  redis.call('HSET', KEYS[1], ARGV[1]..'t', ARGV[2])
else
  if seq <= tail then
    if seq <= tonumber(m[2] or '0') then return {'D', m[2] or '0'} end
    return {'T', cur}
  end
  if seq > tail + 1 then return {'H', m[1]} end
  if cur ~= '' then return {'T', cur} end
  if ARGV[1] == 'u' and (m[4] or '') == '' then
    redis.call('HSET', KEYS[1], 'ut', ARGV[2], 'us', ARGV[2], 'acc', ARGV[3])
  else
    redis.call('HSET', KEYS[1], ARGV[1]..'t', ARGV[2], ARGV[1]..'s', ARGV[2])
  end
end
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[7], ARGV[2]..'-0', 'f', ARGV[5])
if ARGV[9] ~= '' then redis.call('PUBLISH', ARGV[9], 'W' .. ARGV[5]) end
if cur ~= '' then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
  return {'A'}
end
if term ~= '' then
  redis.call('HSET', KEYS[1], 'term', term, 'tms', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[8])
  return {'F', m[5] or '', m[6] or ''}
end
return {'A'}
