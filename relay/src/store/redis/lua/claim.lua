
local t = redis.call('TIME')
local gen = tonumber(t[1]) * 1000000 + tonumber(t[2])
local cur = redis.call('HMGET', KEYS[1], 'gen', 'ci', 'hm')
local stored = tonumber(cur[1] or '0') or 0
-- A connection of the connector process that made the stored claim, with
-- an earlier Hello (within the window): an attempt the connector gave up,
-- finishing late. It does not take the peer from the later one.
if cur[2] and cur[2] == ARGV[5] then
  local held, hello = tonumber(cur[3] or '0') or 0, tonumber(ARGV[6]) or 0
  if held > hello and held - hello <= (tonumber(ARGV[7]) or 0) then return 'S' end
end
local floor = tonumber(ARGV[3]) or 0
if stored + 1 > gen then gen = stored + 1 end
if floor + 1 > gen then gen = floor + 1 end
gen = string.format('%.0f', gen)
redis.call('HSET', KEYS[1], 'gen', gen, 'node', ARGV[1], 'session', ARGV[2], 'inc', ARGV[4], 'ci', ARGV[5], 'hm', ARGV[6])
return gen
