-- sliding_buckets.lua: exact over g epoch-aligned buckets of window / g.
-- State: a hash {l = last bucket id, s = sum, <id mod g> = count of that
-- bucket}, expiring when its newest non-empty bucket slides out.
-- apply(key, limit, window, g, hits, now) -> allowed, remaining, reset, retry, delay
--   the count is the current bucket plus the g - 1 before it;
--   allow iff count + hits <= limit.
-- refund(key, limit, window, g, hits, at, now): give back hits admitted at
--   `at`, if its bucket is still counted.

ALG.sb = {}

-- Load the ring at bucket `bid`, dropping the buckets that slid out since
-- the last call (written back: the state they leave is the same state).
local function sb_load(key, g, bid)
  local h = redis.call('HMGET', key, 'l', 's')
  local last, sum = tonumber(h[1]), tonumber(h[2])
  if not last or not sum then
    return bid, 0
  end
  if bid < last then bid = last end
  if bid - last >= g then
    -- Every bucket slid out: an empty ring at bid (kept, as the memory
    -- store keeps it, so a clock step back sees the same).
    redis.call('DEL', key)
    redis.call('HSET', key, 'l', int(bid), 's', '0')
    expire(key, 0)
    return bid, 0
  end
  if bid > last then
    local fields, n = {}, 0
    for id = last + 1, bid do
      n = n + 1
      fields[n] = int(math.fmod(id, g))
    end
    local counts = redis.call('HMGET', key, unpack(fields))
    local dropped = 0
    for i = 1, n do dropped = dropped + (tonumber(counts[i]) or 0) end
    if dropped > 0 then
      redis.call('HDEL', key, unpack(fields))
      sum = sum - dropped
      redis.call('HSET', key, 's', int(sum))
    end
    redis.call('HSET', key, 'l', int(bid))
  end
  return bid, sum
end

-- The counts of buckets `from`..`to`, oldest first: this region's, plus
-- the peers' for a global check.
local function sb_counts(key, g, from, to)
  local fields, n = {}, 0
  for id = from, to do
    n = n + 1
    fields[n] = int(math.fmod(id, g))
  end
  local raw = redis.call('HMGET', key, unpack(fields))
  local counts = {}
  for i = 1, n do counts[i] = (tonumber(raw[i]) or 0) + remote(from + i - 1) end
  return counts
end

-- The peers' counts over buckets `from`..`to` (0 for a regional check).
local function sb_remote(from, to)
  if not REMOTE then return 0 end
  local sum = 0
  for id = from, to do sum = sum + (REMOTE[id] or 0) end
  return sum
end

function ALG.sb.apply(key, l, w, g, hits, now)
  local size = w / g
  local bid = divmod(now, size)
  local sum
  bid, sum = sb_load(key, g, bid)
  if bid * size > now then now = bid * size end
  -- Bucket `id` stops counting when bucket id + g begins.
  local function gone_at(id) return (id + g) * size - now end
  local oldest = math.max(bid + 1 - g, 0)
  local function reset(counts, s)
    if s == 0 then return 0 end
    for i = #counts, 1, -1 do
      if counts[i] > 0 then return gone_at(oldest + i - 1) end
    end
    return 0
  end
  -- Every region's count (global), or this one's; `own` is this region's.
  local own = sum
  sum = own + sb_remote(oldest, bid)
  if hits == 0 or hits <= l - sum or FORCE then
    hits = math.min(hits, MAXN - own)
    if hits > 0 then
      sum = sum + hits
      redis.call('HINCRBY', key, int(math.fmod(bid, g)), int(hits))
      redis.call('HSET', key, 'l', int(bid), 's', int(own + hits))
      local ttl = gone_at(bid)
      expire(key, ttl)
      return true, math.max(l - sum, 0), ttl, -1, 0
    end
    if sum == 0 then return true, l, 0, -1, 0 end
    return true, math.max(l - sum, 0), reset(sb_counts(key, g, oldest, bid), sum), -1, 0
  end
  local counts = sb_counts(key, g, oldest, bid)
  local retry = -1
  if hits <= l then
    local need = sum + hits - l
    retry = gone_at(bid)
    for i = 1, #counts do
      need = need - counts[i]
      if need <= 0 then
        retry = gone_at(oldest + i - 1)
        break
      end
    end
  end
  return false, math.max(l - sum, 0), reset(counts, sum), retry, 0
end

-- give_back(key, limit, window, g, hits, now): a refund that names no
-- request (Limit::give_back): the newest bucket first, then the older ones
-- still in the window.
function ALG.sb.give_back(key, l, w, g, hits, now)
  local size = w / g
  local bid, sum = sb_load(key, g, divmod(now, size))
  local left = math.min(hits, sum)
  if left == 0 then return end
  local from = math.max(bid + 1 - g, 0)
  local fields, n = {}, 0
  for id = bid, from, -1 do
    n = n + 1
    fields[n] = int(math.fmod(id, g))
  end
  local counts = redis.call('HMGET', key, unpack(fields))
  local set, m = {}, 0
  for i = 1, n do
    local c = tonumber(counts[i]) or 0
    local take = math.min(left, c)
    if take > 0 then
      set[m + 1], set[m + 2] = fields[i], int(c - take)
      m = m + 2
      left = left - take
    end
    if left == 0 then break end
  end
  redis.call('HSET', key, 's', int(sum - math.min(hits, sum)), unpack(set))
end

function ALG.sb.refund(key, l, w, g, hits, at, now)
  local size = w / g
  local bid = divmod(at, size)
  local h = redis.call('HMGET', key, 'l', 's', int(math.fmod(bid, g)))
  local last, sum, count = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]) or 0
  if not last or not sum or bid > last or last - bid >= g then return end
  local take = math.min(hits, count)
  if take == 0 then return end
  redis.call('HSET', key, int(math.fmod(bid, g)), int(count - take), 's', int(sum - take))
end
