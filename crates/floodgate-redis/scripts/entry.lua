-- entry.lua: decides every limit of one request (those in one cluster slot)
-- in one call, all or nothing. Loaded after lib.lua and the algorithms.
--
-- KEYS[i]      the counter key of check i (all in one hash slot).
-- ARGV[1]      now in microseconds since the Unix epoch, or "" to read the
--              Redis server's TIME (the default: instances with skewed
--              clocks still agree). With a given time, keys expire an
--              hour late (Redis expires them on its own clock).
-- ARGV[2]      "apply" or "refund".
-- ARGV[3 + 6 * (i - 1)] .. ARGV[8 + 6 * (i - 1)], for check i:
--              algorithm (fw fixed_window, sl sliding_log, sw sliding_window,
--              sb sliding_buckets, gc gcra / token_bucket / leaky_bucket
--              meter, sh leaky_bucket shaper), limit, window (us), burst or
--              granularity (0 when the algorithm takes neither), hits (at
--              most capacity + 1: every larger request is denied alike),
--              and for "apply" 1 when a denial denies the request (0 for a
--              shadow-mode limit), for "refund" the time the hits were
--              taken.
--
-- "apply" decides the checks in order, each seeing the ones before it; when
-- an enforced check is denied, the checks that allowed are refunded at once
-- (which leaves no trace), so the request takes nothing anywhere. It returns
-- {now, denied (1/0), then per check: allowed (1/0), remaining, reset_after
-- (us), retry_after (us, -1 for none), delay (us)}.
-- "refund" gives the hits back (a request whose other limits, in another
-- slot, denied it) and returns {now}.

local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[1])
  TTL_SLACK_MS = 3600000
end
local refunding = ARGV[2] == 'refund'
if not refunding and ARGV[2] ~= 'apply' then
  return redis.error_reply('floodgate: ARGV[2] must be apply or refund, not ' .. tostring(ARGV[2]))
end
if #ARGV ~= 2 + 6 * #KEYS then
  return redis.error_reply('floodgate: expected ' .. (2 + 6 * #KEYS) .. ' arguments for ' .. #KEYS .. ' keys, got ' .. #ARGV)
end

local checks = {}
for i = 1, #KEYS do
  local a = 3 + 6 * (i - 1)
  local alg = ALG[ARGV[a]]
  if not alg then
    return redis.error_reply('floodgate: unknown algorithm ' .. tostring(ARGV[a]))
  end
  checks[i] = {
    key = KEYS[i], alg = alg, l = tonumber(ARGV[a + 1]), w = tonumber(ARGV[a + 2]),
    p = tonumber(ARGV[a + 3]), hits = tonumber(ARGV[a + 4]), flag = tonumber(ARGV[a + 5]),
  }
end

local function refund(c, at)
  if c.l > 0 and c.hits > 0 then
    c.alg.refund(c.key, c.l, c.w, c.p, c.hits, at, math.max(now, at))
  end
end

if refunding then
  for i = 1, #checks do refund(checks[i], checks[i].flag) end
  return { now }
end

local out = { now, 0 }
local denied = false
for i = 1, #checks do
  local c = checks[i]
  local allowed, remaining, reset, retry, delay
  if c.l == 0 then
    allowed, remaining, reset, retry, delay = c.hits == 0, 0, 0, -1, 0
  else
    allowed, remaining, reset, retry, delay = c.alg.apply(c.key, c.l, c.w, c.p, c.hits, now)
  end
  c.allowed = allowed
  if not allowed and c.flag == 1 then denied = true end
  local b = 3 + 5 * (i - 1)
  if allowed then out[b] = 1 else out[b] = 0 end
  out[b + 1], out[b + 2], out[b + 3], out[b + 4] = remaining, reset, retry, delay
end
if denied then
  out[2] = 1
  for i = #checks, 1, -1 do
    if checks[i].allowed then refund(checks[i], now) end
  end
end
return out
