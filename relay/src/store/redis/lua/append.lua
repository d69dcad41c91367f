
local m = redis.call('HMGET', KEYS[1], ARGV[1]..'t', ARGV[1]..'s', 'term', 'acc', 'dl', 'callee', 'db', 'ub')
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
  local party = ARGV[11]
  if ARGV[1] == 'u' then party = m[6] end
  if ARGV[10] ~= party then return {'P'} end
  if seq <= tail then
    if seq <= tonumber(m[2] or '0') then return {'D', m[2] or '0'} end
    return {'T', cur}
  end
  if seq > tail + 1 then return {'H', m[1]} end
  if cur ~= '' then return {'T', cur} end
  if tonumber(m[7] or '0') + tonumber(m[8] or '0') + #ARGV[5] > tonumber(ARGV[12]) then
    return {'B', 'd'}
  end
  if ARGV[13] ~= '1' then return {'B', 'p'} end
  if ARGV[1] == 'u' and (m[4] or '') == '' then
    redis.call('HSET', KEYS[1], 'ut', ARGV[2], 'us', ARGV[2], 'acc', ARGV[3])
  else
    redis.call('HSET', KEYS[1], ARGV[1]..'t', ARGV[2], ARGV[1]..'s', ARGV[2])
  end
end
local trimmed = 0
local over = redis.call('XLEN', KEYS[2]) + 1 - tonumber(ARGV[7])
if over > 0 then
  for _, e in ipairs(redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', over)) do
    trimmed = trimmed + #e[2][2]
  end
end
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[7], ARGV[2]..'-0', 'f', ARGV[5])
redis.call('HINCRBY', KEYS[1], ARGV[1]..'b', string.format('%.0f', #ARGV[5] - trimmed))
trimmed = string.format('%.0f', trimmed)
if ARGV[9] ~= '' then redis.call('PUBLISH', ARGV[9], 'W' .. ARGV[5]) end
if cur ~= '' then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
  return {'A', trimmed}
end
if term ~= '' then
  redis.call('HSET', KEYS[1], 'term', term, 'tms', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[8])
  redis.call('PEXPIRE', KEYS[3], ARGV[8])
  return {'F', m[5] or '', m[6] or '', trimmed}
end
return {'A', trimmed}
