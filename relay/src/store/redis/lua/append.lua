
local m = redis.call('HMGET', KEYS[1], 'dt', 'ds', 'ut', 'us', 'term', 'acc', 'dl', 'callee', 'db', 'ub', 'dz', 'uz')
if not m[1] then return {'U'} end
local maxlen = tonumber(ARGV[1])
local maxbytes = tonumber(ARGV[4])
local maxpeer = tonumber(ARGV[5])
local fused = #KEYS > 5
local budgets = {}
local function budget_of(k)
  local budget = budgets[k]
  if not budget then
    local key = KEYS[5 + k]
    local v = redis.call('HMGET', key, 'total', ARGV[6])
    budget = {total = tonumber(v[1] or '0'), member = tonumber(v[2] or '0')}
    budgets[k] = budget
  end
  return budget
end
-- The peer budget a peer's entries are charged to (on a single server, by
-- their budget index; none for the relay's, and none in a cluster, where
-- `charge` charged them before), read on first use.
local function charged_to(origin, charge)
  if not fused or origin == 'r' or charge == '0' then return nil end
  return budget_of(tonumber(charge))
end
-- Whether `size` more bytes would pass that budget.
local function over_budget(origin, charge, size)
  local budget = charged_to(origin, charge)
  return budget ~= nil and budget.total + size > maxpeer
end
local log = {d = KEYS[2], u = KEYS[3]}
-- The sizes of a log's newest entries, once the log has reached its cap:
-- what a trim gives back, without reading the frames. Meta `dz`/`uz` is
-- the log's tail when its list was last in step with it: a list is this
-- log's only while that is still the tail (an append by a relay that does
-- not list leaves it behind), else it is started again.
local sizes = {d = KEYS[4], u = KEYS[5]}
local tails = {d = m[1], u = m[3] or '0'}
local has_list = {d = m[11] ~= nil, u = m[12] ~= nil}
local listing = {d = has_list.d and m[11] == tails.d, u = has_list.u and m[12] == tails.u}
local listed = {}
local unlisted = {}
local pushed = {}
local now_ms = nil
local tail = {d = tonumber(tails.d), u = tonumber(tails.u)}
local sents = {d = m[2] or '0', u = m[4] or '0'}
local sent = {d = tonumber(sents.d), u = tonumber(sents.u)}
local held = tonumber(m[9] or '0') + tonumber(m[10] or '0')
local cur = m[5] or ''
local acc = m[6] or ''
local party = {d = ARGV[3], u = m[8]}
-- The entries come in runs: nine header arguments (count, dir, first seq,
-- origin, the terminal of the run's last entry, now, wake channel, sender,
-- budget), then the run's frames; a run's sequences are consecutive and
-- only its last entry may carry a terminal.
local runs = {}
local left = {d = 0, u = 0}
do
  local b = 8
  while b <= #ARGV do
    local count = tonumber(ARGV[b])
    runs[#runs + 1] = b
    left[ARGV[b + 1]] = left[ARGV[b + 1]] + count
    b = b + 9 + count
  end
end
local added = {d = 0, u = 0}
local len = {}
local queue = {}
local head = {}
local qlen = {}
local moved = {}
local term_ms = nil
local term_at = nil
local out = {}
local n = 0
-- Stream ids and listed sizes go to redis.call as strings: Redis formats
-- a Lua number argument with snprintf('%.17g'), which cost about an eighth
-- of the script's instructions per entry at a log's cap. An id is the
-- decimal of its tens, formatted once per ten sequences, and a digit; a
-- size is formatted once per distinct size in the call. Globals used per
-- entry are read once into locals.
local digits = {'0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}
local id_tens, id_prefix = -1, ''
local size_strs = {}
local floor, argv, call = math.floor, ARGV, redis.call
-- The first entry appended to a log in this call: its length, and the
-- sizes of the entries the batch's appends may trim (oldest first).
local function touch(dir, seq)
  local l
  -- A log holds at most one entry per sequence up to its tail, so when
  -- the tail and this batch's entries fit under maxlen nothing is trimmed
  -- and the tail bounds the length: no XLEN needed.
  local capped = seq - 1 + left[dir] > maxlen
  if capped then l = redis.call('XLEN', log[dir]) else l = seq - 1 end
  queue[dir] = {}
  head[dir] = 1
  qlen[dir] = 0
  if capped or listing[dir] then
    -- From its first batch at the cap on, every entry of the log gets its
    -- size listed: the list holds the sizes of the newest entries, the
    -- older ones (appended before) are read from the log.
    local count = 0
    if listing[dir] then
      count = redis.call('LLEN', sizes[dir])
    else
      -- Nothing of an earlier list, or of an earlier delegation under
      -- this key, may count.
      redis.call('DEL', sizes[dir])
      listing[dir] = true
      has_list[dir] = true
    end
    if count > l then
      -- Longer than the log: not this log's; read the log instead.
      redis.call('DEL', sizes[dir])
      count = 0
    end
    listed[dir] = count
    unlisted[dir] = l - count
    pushed[dir] = {}
  end
  local over = math.min(l, l + left[dir] - maxlen)
  if over > 0 then
    local q, k = queue[dir], 0
    local from_log = over
    if listed[dir] then from_log = math.min(over, unlisted[dir]) end
    if from_log > 0 then
      for _, e in ipairs(redis.call('XRANGE', log[dir], '-', '+', 'COUNT', from_log)) do
        k = k + 1
        q[k] = #e[2][2]
      end
    end
    if over > from_log then
      for _, z in ipairs(redis.call('LRANGE', sizes[dir], 0, over - from_log - 1)) do
        k = k + 1
        q[k] = tonumber(z)
      end
    end
    qlen[dir] = k
  end
  len[dir] = l
end
-- Appends frames ARGV[at .. at + count - 1] to a log at sequences first,
-- first + 1, ...: each adds its size to the log's held bytes and takes off
-- what the log's maxlen trims because of it, and with a peer budget
-- (fused), is charged to it and gives it the trimmed bytes back (at most
-- what it holds of this delegation), entry by entry. Returns the bytes
-- trimmed.
local function put(dir, first, at, count, wake, budget)
  if not len[dir] then touch(dir, first) end
  local key, q, h, qn, l = log[dir], queue[dir], head[dir], qlen[dir], len[dir]
  local p = pushed[dir]
  local pn = p and #p
  local bt, bm
  if budget then bt, bm = budget.total, budget.member end
  local size_sum, trimmed = 0, 0
  for k = 0, count - 1 do
    local frame = argv[at + k]
    local size = #frame
    size_sum = size_sum + size
    qn = qn + 1
    q[qn] = size
    l = l + 1
    local cut = 0
    while l > maxlen do
      cut = cut + (q[h] or 0)
      q[h] = nil
      h = h + 1
      l = l - 1
    end
    local seq = first + k
    local id
    if seq < 1e15 then
      local tens = floor(seq / 10)
      if tens ~= id_tens then
        id_tens = tens
        if tens == 0 then id_prefix = '' else id_prefix = string.format('%d', tens) end
      end
      id = id_prefix .. digits[seq - tens * 10 + 1]
    else
      id = string.format('%.0f', seq)
    end
    call('XADD', key, id, 'f', frame)
    if p then
      local z = size_strs[size]
      if not z then
        z = string.format('%d', size)
        size_strs[size] = z
      end
      pn = pn + 1
      p[pn] = z
    end
    if wake ~= '' then call('PUBLISH', wake, 'W' .. frame) end
    if bt then
      bt = bt + size
      bm = bm + size
      if cut > 0 then
        -- Trimmed bytes go back, at most what it holds of this delegation.
        local back = cut
        if back > bm then back = bm end
        bm = bm - back
        bt = bt - back
      end
    end
    trimmed = trimmed + cut
  end
  if bt then budget.total, budget.member = bt, bm end
  head[dir], qlen[dir], len[dir] = h, qn, l
  held = held + size_sum - trimmed
  added[dir] = added[dir] + size_sum - trimmed
  return trimmed
end
for _, b in ipairs(runs) do
  local count, dir, first, origin, run_term = tonumber(ARGV[b]), ARGV[b + 1], tonumber(ARGV[b + 2]),
    ARGV[b + 3], ARGV[b + 4]
  local now, wake, sender, charge = ARGV[b + 5], ARGV[b + 6], ARGV[b + 7], ARGV[b + 8]
  local at = b + 9
  now_ms = now
  -- A run that every check would let through entry by entry is appended
  -- whole: the sequence and the party are checked once, and the budgets
  -- against the run's size (an upper bound of what each entry sees).
  local whole = false
  local t = tail[dir]
  if first == t + 1 and (run_term == '' or cur == '') then
    if origin == 'r' then
      whole = true
    elseif sender == party[dir] and cur == '' then
      local size = 0
      for k = at, at + count - 1 do size = size + #argv[k] end
      if held + size <= maxbytes then
        if not fused then
          whole = charge == '1'
        else
          whole = not over_budget(origin, charge, size)
        end
      end
    end
  end
  if whole then
    local trimmed = put(dir, first, at, count, wake, charged_to(origin, charge))
    if origin ~= 'r' then
      if dir == 'u' and acc == '' then acc = origin end
      sent[dir] = first + count - 1
      sents[dir] = string.format('%d', sent[dir])
    end
    tail[dir] = first + count - 1
    tails[dir] = string.format('%d', tail[dir])
    moved[dir] = true
    if count > 1 then
      -- The run's entries before its last: appended, nothing trimmed.
      out[n + 1] = 'R'
      out[n + 2] = count - 1
      n = n + 2
    end
    local code = 'A'
    if run_term ~= '' then
      cur = run_term
      term_ms = now
      code = 'F'
      term_at = n + 1
    end
    out[n + 1] = code
    out[n + 2] = trimmed
    n = n + 2
    left[dir] = left[dir] - count
  else
    for k = 0, count - 1 do
      local seq = first + k
      local seqs = string.format('%d', seq)
      local frame = ARGV[at + k]
      local term = ''
      if k == count - 1 then term = run_term end
      t = tail[dir]
      local code, value = nil, ''
      if origin == 'r' then
        if seq ~= t + 1 then
          code, value = 'C', tails[dir]
        elseif term ~= '' and cur ~= '' then
          code, value = 'T', cur
        else
          tail[dir], tails[dir] = seq, seqs
          moved[dir] = true
        end
      elseif sender ~= party[dir] then
        code = 'P'
      elseif seq <= t then
        if seq <= sent[dir] then code, value = 'D', sents[dir] else code, value = 'T', cur end
      elseif seq > t + 1 then
        code, value = 'H', tails[dir]
      elseif cur ~= '' then
        code, value = 'T', cur
      elseif held + #frame > maxbytes then
        code, value = 'B', 'd'
      elseif not fused and charge ~= '1' then
        code, value = 'B', 'p'
      elseif over_budget(origin, charge, #frame) then
        code, value = 'B', 'p'
      else
        if dir == 'u' and acc == '' then acc = origin end
        tail[dir], tails[dir] = seq, seqs
        sent[dir], sents[dir] = seq, seqs
        moved[dir] = true
      end
      if code == nil then
        local trimmed = put(dir, seq, at + k, 1, wake, charged_to(origin, charge))
        if cur == '' and term ~= '' then
          cur = term
          term_ms = now
          code = 'F'
          term_at = n + 1
        else
          code = 'A'
        end
        value = trimmed
      end
      left[dir] = left[dir] - 1
      out[n + 1] = code
      out[n + 2] = value
      n = n + 2
    end
  end
end
local fields = {}
if moved.d then
  fields[#fields + 1] = 'dt'
  fields[#fields + 1] = tails.d
  fields[#fields + 1] = 'ds'
  fields[#fields + 1] = sents.d
end
if moved.u then
  fields[#fields + 1] = 'ut'
  fields[#fields + 1] = tails.u
  fields[#fields + 1] = 'us'
  fields[#fields + 1] = sents.u
end
if acc ~= (m[6] or '') then
  fields[#fields + 1] = 'acc'
  fields[#fields + 1] = acc
end
if term_ms then
  fields[#fields + 1] = 'term'
  fields[#fields + 1] = cur
  fields[#fields + 1] = 'tms'
  fields[#fields + 1] = term_ms
end
for dir, _ in pairs(pushed) do
  fields[#fields + 1] = dir .. 'z'
  fields[#fields + 1] = tails[dir]
end
local held_at = {d = tonumber(m[9] or '0'), u = tonumber(m[10] or '0')}
for dir, _ in pairs(log) do
  if len[dir] then
    fields[#fields + 1] = dir .. 'b'
    fields[#fields + 1] = string.format('%.0f', held_at[dir] + added[dir])
  end
end
if #fields > 0 then redis.call('HSET', KEYS[1], unpack(fields)) end
for k, budget in pairs(budgets) do
  local key = KEYS[5 + k]
  if budget.total <= 0 then
    redis.call('DEL', key)
  elseif budget.member > 0 then
    redis.call('HSET', key, ARGV[6], string.format('%.0f', budget.member),
      'total', string.format('%.0f', budget.total))
  else
    redis.call('HDEL', key, ARGV[6])
    redis.call('HSET', key, 'total', string.format('%.0f', budget.total))
  end
end
for dir, key in pairs(log) do
  if len[dir] and head[dir] > 1 then redis.call('XTRIM', key, 'MAXLEN', ARGV[1]) end
end
for dir, p in pairs(pushed) do
  for at = 1, #p, 512 do
    redis.call('RPUSH', sizes[dir], unpack(p, at, math.min(at + 511, #p)))
  end
  -- The trim dropped the oldest entries: those the list holds go too.
  local gone = head[dir] - 1 - unlisted[dir]
  if gone > 0 then redis.call('LTRIM', sizes[dir], gone, -1) end
end
if term_ms then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
  for dir, key in pairs(sizes) do
    if has_list[dir] then redis.call('PEXPIRE', key, ARGV[2]) end
  end
elseif cur ~= '' and (len.d or len.u) then
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then
    for dir, key in pairs(log) do
      if len[dir] then redis.call('PEXPIRE', key, ttl) end
      if pushed[dir] then redis.call('PEXPIRE', sizes[dir], ttl) end
    end
  end
elseif next(pushed) and m[7] then
  -- An open delegation's list outlives it by at most its deadline and the
  -- finished TTL, whichever relay ends and drops the delegation.
  local left_ms = math.max(0, math.min(tonumber(m[7]) - tonumber(now_ms), 1e12))
  local ttl = string.format('%.0f', left_ms + tonumber(ARGV[2]))
  for dir, _ in pairs(pushed) do redis.call('PEXPIRE', sizes[dir], ttl) end
end
if term_ms and ARGV[7] == '1' and m[7] and m[8] then
  local nk = #KEYS
  if KEYS[nk - 4] == 'oab:p:{' .. m[8] .. '}:open'
      and KEYS[nk] == 'oab:pb:{' .. m[8] .. '}' then
    local member = ARGV[6]
    local function pad(d) return string.rep('0', 20 - #d) .. d end
    redis.call('SREM', KEYS[nk - 5], member)
    redis.call('SREM', KEYS[nk - 4], member)
    redis.call('ZREM', KEYS[nk - 3], pad(m[7]) .. '|' .. member)
    redis.call('ZADD', KEYS[nk - 2], 0, pad(term_ms) .. '|' .. member .. '|' .. m[8])
    -- Its bytes leave both peers' budgets: they bound what a peer holds
    -- open, not what retention keeps.
    for _, key in ipairs({KEYS[nk - 1], KEYS[nk]}) do
      local held = tonumber(redis.call('HGET', key, member) or '0')
      if held > 0 then
        local total = redis.call('HINCRBY', key, 'total', string.format('%.0f', -held))
        redis.call('HDEL', key, member)
        if total <= 0 then redis.call('DEL', key) end
      end
    end
    out[term_at] = 'I'
  end
end
out[n + 1] = m[7] or ''
out[n + 2] = m[8] or ''
return out
