-- sliding_log.lua: exact; every admitted (time, hits) of the last window.
-- State: a hash used as a queue: {s = sum of hits, h = index of the oldest
-- entry, t = index after the newest, <index> = "<time> <hits>"}, expiring
-- when its newest entry leaves the window. Entries at the same microsecond
-- are merged, so a log holds at most `limit` entries.
-- apply(key, limit, window, _, hits, now) -> allowed, remaining, reset, retry, delay
--   allow iff the hits in (now - window, now] plus hits <= limit.
-- refund(key, limit, window, _, hits, at, now): give back hits admitted at
--   `at` from the entry that recorded them, unless it may have left the
--   window already.

ALG.sl = {}

local function sl_entry(key, i)
  local v = redis.call('HGET', key, int(i))
  if not v then return nil end
  local t, h = string.match(v, '^(%d+) (%d+)$')
  return tonumber(t), tonumber(h)
end

function ALG.sl.apply(key, l, w, _, hits, now)
  local st = redis.call('HMGET', key, 's', 'h', 't')
  local sum, head, tail = tonumber(st[1]) or 0, tonumber(st[2]) or 0, tonumber(st[3]) or 0
  local newest_t, newest_h
  if tail > head then
    newest_t, newest_h = sl_entry(key, tail - 1)
    if newest_t and newest_t > now then now = newest_t end
  end
  -- Drop the entries that left the window (the same state: written back).
  local dropped = 0
  while head < tail do
    local t, h = sl_entry(key, head)
    if t and t + w > now then break end
    redis.call('HDEL', key, int(head))
    dropped = dropped + (h or 0)
    head = head + 1
  end
  if dropped > 0 or head == tail then
    sum = sum - dropped
    if head == tail then
      if tail > 0 then redis.call('DEL', key) end
      sum, head, tail, newest_t = 0, 0, 0, nil
    else
      redis.call('HSET', key, 's', int(sum), 'h', int(head))
    end
  end
  local function reset()
    if newest_t then return newest_t + w - now end
    return 0
  end
  if hits == 0 or hits <= l - sum or FORCE then
    hits = math.min(hits, MAXN - sum)
    if hits > 0 then
      sum = sum + hits
      -- A late charge on a full log (limit entries) joins the newest entry,
      -- stamped now: the log never holds more than limit entries.
      if newest_t == now or (FORCE and tail - head >= l) then
        redis.call('HSET', key, int(tail - 1), int(now) .. ' ' .. int(newest_h + hits), 's', int(sum))
        newest_t = now
      else
        redis.call('HSET', key, int(tail), int(now) .. ' ' .. int(hits), 's', int(sum), 'h', int(head), 't', int(tail + 1))
        newest_t = now
      end
      expire(key, w)
    end
    return true, math.max(l - sum, 0), reset(), -1, 0
  end
  local retry = -1
  if hits <= l then
    -- Wait for the oldest entries to leave until the request fits.
    local need = sum + hits - l
    local at = now
    for i = head, tail - 1 do
      local t, h = sl_entry(key, i)
      at = t + w
      need = need - h
      if need <= 0 then break end
    end
    retry = at - now
  end
  return false, math.max(l - sum, 0), reset(), retry, 0
end

-- give_back(key, limit, window, _, hits, now): a refund that names no
-- request (Limit::give_back): the newest entries first.
function ALG.sl.give_back(key, l, w, p, hits, now)
  ALG.sl.apply(key, l, w, p, 0, now)
  local st = redis.call('HMGET', key, 's', 'h', 't')
  local sum, head, tail = tonumber(st[1]), tonumber(st[2]), tonumber(st[3])
  if not sum then return end
  local left = math.min(hits, sum)
  sum = sum - left
  while left > 0 and tail > head do
    local t, h = sl_entry(key, tail - 1)
    local take = math.min(left, h)
    left = left - take
    if take == h then
      redis.call('HDEL', key, int(tail - 1))
      tail = tail - 1
    else
      redis.call('HSET', key, int(tail - 1), int(t) .. ' ' .. int(h - take))
    end
  end
  if tail == head then
    redis.call('DEL', key)
  else
    redis.call('HSET', key, 's', int(sum), 't', int(tail))
  end
end

function ALG.sl.refund(key, l, w, _, hits, at, now)
  if at + w <= now then return end
  local st = redis.call('HMGET', key, 's', 'h', 't')
  local sum, head, tail = tonumber(st[1]), tonumber(st[2]), tonumber(st[3])
  if not sum then return end
  -- The oldest entry at or after `at`.
  for i = head, tail - 1 do
    local t, h = sl_entry(key, i)
    if t and t >= at then
      local take = math.min(hits, h)
      sum = sum - take
      if take == h then
        -- Close the gap: shift the older entries up by one.
        for j = i, head + 1, -1 do
          redis.call('HSET', key, int(j), redis.call('HGET', key, int(j - 1)))
        end
        redis.call('HDEL', key, int(head))
        head = head + 1
        if head == tail then
          redis.call('DEL', key)
          return
        end
        redis.call('HSET', key, 's', int(sum), 'h', int(head))
      else
        redis.call('HSET', key, int(i), int(t) .. ' ' .. int(h - take), 's', int(sum))
      end
      return
    end
  end
end
