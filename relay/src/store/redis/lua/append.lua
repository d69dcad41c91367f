
local m = redis.call('HMGET', KEYS[1], 'dt', 'ds', 'ut', 'us', 'term', 'acc', 'dl', 'callee', 'db', 'ub')
local count = (#ARGV - 4) / 9
local out = {}
if not m[1] then
  for i = 1, count do out[i] = {'U'} end
  return out
end
local maxlen = tonumber(ARGV[1])
local log = {d = KEYS[2], u = KEYS[3]}
local tail = {d = m[1], u = m[3] or '0'}
local sent = {d = m[2] or '0', u = m[4] or '0'}
local held = {d = tonumber(m[9] or '0'), u = tonumber(m[10] or '0')}
local cur = m[5] or ''
local acc = m[6] or ''
local party = {d = ARGV[3], u = m[8]}
local left = {d = 0, u = 0}
for i = 0, count - 1 do
  local dir = ARGV[5 + i * 9]
  left[dir] = left[dir] + 1
end
local added = {d = 0, u = 0}
local len = {}
local queue = {}
local head = {}
local qlen = {}
local trim = {}
local set = {}
local finished = false
for i = 0, count - 1 do
  local b = 4 + i * 9
  local dir, seqs, origin, term, frame = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 5]
  local seq = tonumber(seqs)
  local t = tonumber(tail[dir])
  local reply = nil
  if origin == 'r' then
    if seq ~= t + 1 then
      reply = {'C', tail[dir]}
    elseif term ~= '' and cur ~= '' then
      reply = {'T', cur}
    else
      tail[dir] = seqs
      set[dir .. 't'] = seqs
    end
  elseif ARGV[b + 8] ~= party[dir] then
    reply = {'P'}
  elseif seq <= t then
    if seq <= tonumber(sent[dir]) then reply = {'D', sent[dir]} else reply = {'T', cur} end
  elseif seq > t + 1 then
    reply = {'H', tail[dir]}
  elseif cur ~= '' then
    reply = {'T', cur}
  elseif held.d + held.u + #frame > tonumber(ARGV[4]) then
    reply = {'B', 'd'}
  elseif ARGV[b + 9] ~= '1' then
    reply = {'B', 'p'}
  else
    if dir == 'u' and acc == '' then
      acc = origin
      set['acc'] = origin
    end
    tail[dir] = seqs
    sent[dir] = seqs
    set[dir .. 't'] = seqs
    set[dir .. 's'] = seqs
  end
  if reply == nil then
    if not len[dir] then
      len[dir] = redis.call('XLEN', log[dir])
      queue[dir] = {}
      head[dir] = 1
      qlen[dir] = 0
      local over = math.min(len[dir], len[dir] + left[dir] - maxlen)
      if over > 0 then
        for _, e in ipairs(redis.call('XRANGE', log[dir], '-', '+', 'COUNT', over)) do
          qlen[dir] = qlen[dir] + 1
          queue[dir][qlen[dir]] = #e[2][2]
        end
      end
    end
    local q = queue[dir]
    qlen[dir] = qlen[dir] + 1
    q[qlen[dir]] = #frame
    local trimmed = 0
    local over = len[dir] + 1 - maxlen
    if over > 0 then
      for _ = 1, over do
        trimmed = trimmed + (q[head[dir]] or 0)
        q[head[dir]] = nil
        head[dir] = head[dir] + 1
      end
      len[dir] = maxlen
      trim[dir] = true
    else
      len[dir] = len[dir] + 1
    end
    redis.call('XADD', log[dir], seqs .. '-0', 'f', frame)
    held[dir] = held[dir] + #frame - trimmed
    added[dir] = added[dir] + #frame - trimmed
    if ARGV[b + 7] ~= '' then redis.call('PUBLISH', ARGV[b + 7], 'W' .. frame) end
    if cur == '' and term ~= '' then
      cur = term
      set['term'] = term
      set['tms'] = ARGV[b + 6]
      finished = true
      reply = {'F', m[7] or '', m[8] or '', trimmed}
    else
      reply = {'A', trimmed}
    end
  end
  left[dir] = left[dir] - 1
  out[i + 1] = reply
end
local fields = {}
for f, v in pairs(set) do
  fields[#fields + 1] = f
  fields[#fields + 1] = v
end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
for dir, key in pairs(log) do
  if trim[dir] then redis.call('XTRIM', key, 'MAXLEN', ARGV[1]) end
  if len[dir] then redis.call('HINCRBY', KEYS[1], dir .. 'b', string.format('%.0f', added[dir])) end
end
if finished then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
elseif cur ~= '' and (len.d or len.u) then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then
    for dir, key in pairs(log) do
      if len[dir] then redis.call('PEXPIRE', key, ttl) end
    end
  end
end
return out
