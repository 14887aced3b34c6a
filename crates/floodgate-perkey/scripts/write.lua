-- write.lua: writes per-key entries of one shard (crates/floodgate-perkey,
-- sharded/mod.rs), atomically: the entries, the index, the counts, the
-- shard's version, then a notice to every instance.
--
-- KEYS[1]      the shard's entries, a hash: lookup key -> value (value.rs).
-- KEYS[2]      the shard's index, a sorted set of the lookup keys (score 0).
-- KEYS[3]      the shard's counts, a hash: "<domain>\0<tier>" -> entries.
-- KEYS[4]      the shard's version, a number bumped by every write.
-- ARGV[1]      the channel every instance follows.
-- ARGV[2]      the written lookup keys, a JSON array (the notice's body).
-- ARGV[3]      the shard's number.
-- ARGV[4..]    (lookup key, value) pairs; an empty value deletes the key.
--
-- Publishes "<shard>:<version>:<keys>" on ARGV[1]. Returns, per pair, 1
-- when the key held a value before, else 0. The tier of a value is read as
-- value.rs writes it (a first byte of 1: a tier, named from the tenth byte
-- on).

local function count(c, field, v, by)
  local cut = string.find(field, '\0', 1, true)
  local tier = ''
  if string.byte(v, 1) == 1 then tier = string.sub(v, 10) end
  local k = string.sub(field, 1, (cut or (#field + 1)) - 1) .. '\0' .. tier
  if redis.call('HINCRBY', c, k, by) <= 0 then redis.call('HDEL', c, k) end
end
local out = {}
local e, i, c = KEYS[1], KEYS[2], KEYS[3]
for a = 4, #ARGV, 2 do
  local f, v = ARGV[a], ARGV[a + 1]
  local old = redis.call('HGET', e, f)
  if old then count(c, f, old, -1) end
  if v == '' then
    redis.call('HDEL', e, f)
    redis.call('ZREM', i, f)
  else
    redis.call('HSET', e, f, v)
    redis.call('ZADD', i, 0, f)
    count(c, f, v, 1)
  end
  out[#out + 1] = old and 1 or 0
end
local version = redis.call('INCR', KEYS[4])
redis.call('PUBLISH', ARGV[1], ARGV[3] .. ':' .. version .. ':' .. ARGV[2])
return out
