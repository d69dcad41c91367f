
if redis.call('HGET', KEYS[1], 'session') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'node', 'session')
  return 1
end
return 0
