
local m = redis.call('HMGET', KEYS[1], ARGV[1], 'term')
if not m[1] then return {'U'} end
local term = m[2] or ''
local after = tonumber(ARGV[2])
if after > tonumber(m[1]) then return {'L', m[1], term} end
local first = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)
if #first > 0 then
  local fseq = string.match(first[1][1], '^(%d+)')
  if after + 1 < tonumber(fseq) then return {'T', fseq, term} end
elseif after < tonumber(m[1]) then
  -- Compacted: the caller released the finished delegation.
  return {'T', '0', term}
end
local out = {'E', m[1], term}
if tonumber(ARGV[4]) > 0 then
  local es = redis.call('XRANGE', KEYS[2], ARGV[3], '+', 'COUNT', ARGV[4])
  for _, e in ipairs(es) do
    out[#out + 1] = e[1]
    out[#out + 1] = e[2][2]
  end
end
return out
