-- concurrency.lua: at most `limit` slots held at once by leases, each
-- released by its id or expiring `window` (the lease's length) after it was
-- taken or last extended (floodgate_core's algorithm/concurrency.rs, which
-- this mirrors answer for answer).
-- State, two keys of one hash slot (the second is the first's name + ':l'):
--   <key>    a hash: u = slots held, q = the last lease's sequence number,
--            <seq> = "<id> <slots>" per lease (seq: 15 digits, zero-padded;
--            id: 16 hex digits, or 0 for an anonymous lease), and
--            #<id> = <seq> for a lease with an id;
--   <key>:l  a sorted set of the leases' seqs by expiry (us): the earliest
--            first, and among equal expiries the oldest (equal scores sort
--            by member, and a seq's digits sort as its number).
-- Both expire with the last lease (PEXPIRE, plus the slack) and are deleted
-- once no lease is held, so a key holds at most `limit` leases and goes
-- when they do. Expired leases are dropped whenever the key is met.
-- apply(key, limit, window, _, hits, now): an anonymous acquire (FORCE, a
--   late charge: a peek; a slot is taken before the work or not at all).
-- refund(key, limit, window, _, hits, at, now): undo an anonymous acquire
--   of `hits` (its request was denied by another limit): the newest
--   anonymous lease gives them back.
-- give_back(key, limit, window, _, hits, now): a refund without an id:
--   the earliest-expiring leases give `hits` slots back.
-- And, by lease id (entry.lua's lease argument): cc_acquire, cc_release,
-- cc_extend.

ALG.cc = {}

-- The newest anonymous lease each key took in this call (its seq), so an
-- undo in the same call needs no scan.
local cc_anonymous = {}

local function cc_lease(key, m)
  local v = redis.call('HGET', key, m)
  if not v then return nil, 0 end
  local id, s = string.match(v, '^(%x+) (%d+)$')
  return id, tonumber(s)
end

-- Take lease m (of `id`) out of the hash.
local function cc_unlink(key, m, id)
  if id ~= '0' then
    redis.call('HDEL', key, m, '#' .. id)
  else
    redis.call('HDEL', key, m)
  end
end

-- Forget lease m (id, slots) entirely.
local function cc_forget(key, m, id, slots)
  cc_unlink(key, m, id)
  redis.call('ZREM', key .. ':l', m)
  redis.call('HINCRBY', key, 'u', -slots)
end

-- Drop the leases expired at `now`: the slots they held.
local function cc_prune(key, now)
  local z = key .. ':l'
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', int(now))
  if #gone == 0 then return 0 end
  local freed = 0
  for _, m in ipairs(gone) do
    local id, s = cc_lease(key, m)
    if id then
      freed = freed + s
      cc_unlink(key, m, id)
    end
  end
  redis.call('ZREMRANGEBYSCORE', z, '-inf', int(now))
  -- (Not when nothing was found: a hash evicted under memory pressure is
  -- not made again without an expiry.)
  if freed > 0 then redis.call('HINCRBY', key, 'u', -freed) end
  return freed
end

local function cc_used(key)
  return tonumber(redis.call('HGET', key, 'u')) or 0
end

-- What a concurrency check did to its key's slots, answered in place of
-- its delay (a concurrency limit has none) for the store's accounts: the
-- slots that had expired, and those held before and after, each below
-- 2^17 (a limit is at most 100 000), as ((expired * 2^18) + before) *
-- 2^18 + after, exact below 2^53.
local function cc_account(expired, before, after)
  return (expired * 262144 + before) * 262144 + after
end

-- The last lease's expiry (us), read; false when none is held.
local function cc_last(key)
  local last = redis.call('ZRANGE', key .. ':l', -1, -1, 'WITHSCORES')
  if #last == 0 then return false end
  return tonumber(last[2])
end

-- The keys last as long as their last lease (`last`: its expiry when the
-- caller knows it, else read); none held: gone. Returns `last`.
local function cc_keep(key, now, last)
  if last == nil then last = cc_last(key) end
  if not last then
    redis.call('DEL', key, key .. ':l')
    return false
  end
  expire(key, last - now)
  expire(key .. ':l', last - now)
  return last
end

-- What a request of `hits` slots is answered now, taking nothing:
-- allowed, remaining, reset (until every lease has expired), retry (the
-- earliest time enough leases expire; -1 when none helps), delay. `used`
-- and `last` (cc_last) when the caller knows them, else read.
local function cc_answer(key, l, now, hits, used, last)
  if used == nil then used = cc_used(key) end
  if last == nil then last = cc_last(key) end
  local remaining = math.max(l - used, 0)
  local reset = 0
  if last then reset = math.max(last - now, 0) end
  if hits <= remaining then return true, remaining, reset, -1, 0 end
  local retry = -1
  if hits <= l then
    -- Every lease holds a slot at least: `need` leases are enough.
    local need = used + hits - l
    local first = redis.call('ZRANGE', key .. ':l', 0, need - 1, 'WITHSCORES')
    local at = now
    for j = 1, #first, 2 do
      at = tonumber(first[j + 1])
      local _, s = cc_lease(key, first[j])
      need = need - s
      if need <= 0 then break end
    end
    retry = math.max(at - now, 0)
  end
  return false, remaining, reset, retry, 0
end

-- Acquire `hits` slots as lease `id` ('0': anonymous) when they fit; hits
-- 0 is a peek. A lease already held is extended, not taken twice.
local function cc_acquire(key, l, w, hits, id, now)
  cc_prune(key, now)
  local expires = now + w
  local used = cc_used(key)
  if id ~= '0' and hits > 0 then
    local m = redis.call('HGET', key, '#' .. id)
    if m then
      redis.call('ZADD', key .. ':l', 'XX', int(expires), m)
      return cc_answer(key, l, now, 0, used, cc_keep(key, now))
    end
  end
  local last = cc_last(key)
  local allowed, remaining, reset, retry, delay = cc_answer(key, l, now, hits, used, last)
  if hits == 0 or not allowed then return allowed, remaining, reset, retry, delay end
  local m = string.format('%015d', redis.call('HINCRBY', key, 'q', 1))
  if id ~= '0' then
    redis.call('HSET', key, m, id .. ' ' .. int(hits), '#' .. id, m)
  else
    redis.call('HSET', key, m, '0 ' .. int(hits))
    cc_anonymous[key] = m
  end
  redis.call('HINCRBY', key, 'u', hits)
  redis.call('ZADD', key .. ':l', int(expires), m)
  if not last or expires > last then last = expires end
  return cc_answer(key, l, now, 0, used + hits, cc_keep(key, now, last))
end

-- Release lease `id`, or with nil the earliest-expiring one (the oldest of
-- equals), answered as a peek. A lease already gone frees nothing.
local function cc_release(key, l, now, id)
  cc_prune(key, now)
  local used = cc_used(key)
  local m
  if id then
    m = redis.call('HGET', key, '#' .. id)
  else
    m = redis.call('ZRANGE', key .. ':l', 0, 0)[1]
  end
  if m then
    local lid, s = cc_lease(key, m)
    if lid then
      cc_forget(key, m, lid, s)
      used = used - s
    end
  end
  return cc_answer(key, l, now, 0, used, cc_keep(key, now))
end

-- Extend lease `id` to a lease's length from now: allowed while it was
-- held, denied (no wait helps) once it is gone.
local function cc_extend(key, l, w, now, id)
  cc_prune(key, now)
  local m = redis.call('HGET', key, '#' .. id)
  if m then redis.call('ZADD', key .. ':l', 'XX', int(now + w), m) end
  local _, remaining, reset = cc_answer(key, l, now, 0, nil, cc_keep(key, now))
  if m then return true, remaining, reset, -1, 0 end
  return false, remaining, reset, -1, 0
end

-- Give back up to n slots of lease m: those given back. A lease the hash
-- lacks (evicted under memory pressure) leaves the sorted set.
local function cc_take(key, m, n)
  local id, s = cc_lease(key, m)
  if not id then
    redis.call('ZREM', key .. ':l', m)
    return 0
  end
  local take = math.min(s, n)
  if take == s then
    cc_forget(key, m, id, s)
  else
    redis.call('HSET', key, m, id .. ' ' .. int(s - take))
    redis.call('HINCRBY', key, 'u', -take)
  end
  return take
end

function ALG.cc.apply(key, l, w, _, hits, now)
  if FORCE then hits = 0 end
  return cc_acquire(key, l, w, hits, '0', now)
end

function ALG.cc.give_back(key, l, w, _, hits, now)
  cc_prune(key, now)
  local left = hits
  while left > 0 do
    local m = redis.call('ZRANGE', key .. ':l', 0, 0)[1]
    if not m then break end
    left = left - cc_take(key, m, left)
  end
  cc_keep(key, now)
end

function ALG.cc.refund(key, l, w, _, hits, at, now)
  local m = cc_anonymous[key]
  if not m or not redis.call('HGET', key, m) then
    -- Not taken in this call (a request over several hash slots, undone
    -- by a later call): the newest anonymous lease, by scan.
    m = nil
    local all = redis.call('HGETALL', key)
    for j = 1, #all, 2 do
      local f, v = all[j], all[j + 1]
      if string.byte(f, 1) ~= 35 and f ~= 'u' and f ~= 'q' and string.sub(v, 1, 2) == '0 ' and (not m or f > m) then
        m = f
      end
    end
  end
  if m then cc_take(key, m, hits) end
  cc_keep(key, now)
end
