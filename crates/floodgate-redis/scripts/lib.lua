-- lib.lua: exact integer arithmetic on Lua numbers, and state I/O shared by
-- every algorithm. The store concatenates lib.lua, one file per algorithm
-- and entry.lua (last) into the one script it loads; see entry.lua for the
-- KEYS/ARGV contract of that script.
--
-- Lua numbers are IEEE doubles: exact for integers below 2^53 only. Every
-- value this code stores or returns (times in microseconds since the epoch,
-- counts, limits <= 2^53 - 1, windows <= 365 days) stays below 2^53; wider
-- intermediates (limit * window, up to ~2^98) never appear as one number:
-- products are split with muldivmod, and GCRA times are kept as a pair
-- (whole microseconds, remainder in 1/limit microseconds), as the Rust code
-- keeps them.

local ALG = {}

-- For a `scope: global` check (see global.lua): REMOTE[slot] is the sum of
-- the peer regions' counts in a window or bucket, which the window
-- algorithms add to this region's own count when they decide; nil for a
-- regional check. The state they write stays this region's own count.
local REMOTE = nil
local function remote(slot)
  if REMOTE then return REMOTE[slot] or 0 end
  return 0
end

-- A late charge (a limit charged after the work, entry.lua): the
-- algorithms admit it whatever the count, counts saturating at MAXN.
local FORCE = false
local MAXN = 9007199254740991

-- 2^52: a product below it is exact, and so is the sum of two such values.
local P52 = 4503599627370496

-- (a div m, a mod m) for integers 0 <= a < 2^53, 0 < m < 2^53. C's fmod is
-- exact, so the remainder is; a - r is then an exact multiple of m.
local function divmod(a, m)
  local r = math.fmod(a, m)
  return (a - r) / m, r
end

-- ((a * b + c) div m, (a * b + c) mod m) for integers a, b, c, m below
-- 2^53 (m > 0) whose quotient is below 2^53, however wide a * b is: binary
-- long multiplication of b by (a mod m), keeping the running value as
-- (quotient, remainder < m) so that no intermediate reaches 2^53.
local function muldivmod(a, b, c, m)
  local p = a * b
  if p < P52 and c < P52 then
    return divmod(p + c, m)
  end
  local aq, ar = divmod(a, m)
  local q, r = divmod(c, m)
  q = q + aq * b
  local bits, n, x = {}, 0, b
  while x > 0 do
    local bit = math.fmod(x, 2)
    n = n + 1
    bits[n] = bit
    x = (x - bit) / 2
  end
  -- (pq, pr) = ar * (the bits of b seen so far), as quotient and remainder.
  local pq, pr = 0, 0
  for i = n, 1, -1 do
    pq = pq * 2
    if pr >= m - pr then pr = pr - (m - pr); pq = pq + 1 else pr = pr + pr end
    if bits[i] == 1 then
      if pr >= m - ar then pr = pr - (m - ar); pq = pq + 1 else pr = pr + ar end
    end
  end
  q = q + pq
  if r >= m - pr then r = r - (m - pr); q = q + 1 else r = r + pr end
  return q, r
end

-- An integer as a decimal string, exactly (tostring keeps 14 digits only).
local function int(x)
  return string.format('%.0f', x)
end

-- Extra milliseconds on every expiry: entry.lua sets an hour when the
-- caller gives the time (tests, replays), because Redis expires keys on its
-- own clock, not on the given one.
local TTL_SLACK_MS = 2

-- String states (fixed_window, sliding_window, gcra) are read and written
-- through a per-call cache: every string-state key of the call is read
-- with one MGET before the first decision (prefetch, called by entry.lua),
-- and a key is written with one SET when the call ends (flush, called by
-- entry.lua), however many of the batch's requests decide on it. A batch
-- of n requests on n keys then costs one MGET and n SETs, and on one hot
-- key one MGET and one SET; the answers are the same, as each request sees
-- the state the ones before it left.
--
-- raw[key]: the string MGET read (false when missing), parsed on first
-- use; cached[key]: the parsed numbers, or false for a missing (or
-- malformed) state; written[key]: the expiry in ms of a state to SET;
-- order: the keys written, in order.
local raw, cached, written, order = {}, {}, {}, {}

-- The "no peers' counts" mark of a global window key's state (global.lua):
-- a leading 0 on its first number, which every reader of the state,
-- tonumber and older builds included, reads as the same number ("012 3"
-- is slot 12, count 3; an older build writes it back unmarked, which only
-- makes the next decision read G:x). A marked state says that when it
-- was written its key had no G:x, and every merge that writes G:x
-- since has removed the mark (gunmark): a decision on an `eventual`
-- rule then need not read G:x. quiet[S] for a state S a call's checks may
-- decide so: true while its G:x is neither named nor read (its state is
-- marked), else G:x's name; loud[S] when one of them reads G:x whatever
-- the mark. flush() marks a quiet state whose G:x is unread or missing.
local quiet, loud = {}, {}
local MARK_KEEP_MS = 1000
local function marked(v)
  if not v then return false end
  local a, b = string.byte(v, 1, 2)
  return a == 48 and b ~= nil and b >= 48 and b <= 57
end

-- Read the states of `keys` (a list without repeats) for numbers(), in
-- chunks so no call passes Lua's limit on unpacked values.
local function prefetch(keys)
  local chunk = 512
  for from = 1, #keys, chunk do
    local to = math.min(from + chunk - 1, #keys)
    local values = redis.call('MGET', unpack(keys, from, to))
    for i = from, to do
      raw[keys[i]] = values[i - from + 1]
    end
  end
end

-- A string read by prefetch (or now, when it was not): false when missing.
-- For the other strings a call reads (a global key's G:x, global.lua), not
-- for states: those go through numbers().
local function fetched(key)
  local v = raw[key]
  if v == nil then
    v = redis.call('GET', key)
    raw[key] = v
  end
  return v
end

-- Keep a string state of the numbers a, b (and c) for `ttl_us`
-- microseconds (rounded down to whole milliseconds, plus the slack). A
-- state whose wait is over is kept for the slack too, not deleted: after a
-- clock step back it still counts. The cached table is updated in place:
-- callers read the numbers out of it before they put.
local function put(key, ttl_us, a, b, c)
  local s = cached[key]
  if s then
    s[1], s[2], s[3] = a, b, c
  else
    cached[key] = { a, b, c }
  end
  if not written[key] then order[#order + 1] = key end
  written[key] = math.floor(math.max(ttl_us, 0) / 1000) + TTL_SLACK_MS
end

-- Write every state put in this call. The expiry goes as a number (Redis
-- prints an integer below 2^53 exactly; it is at most a year in ms); the
-- state's numbers may reach 2^53 and go through '%.0f', one format per key.
local function flush()
  for i = 1, #order do
    local key = order[i]
    local s = cached[key]
    local x = quiet[key]
    local px = written[key]
    local f2, f3 = '%.0f %.0f', '%.0f %.0f %.0f'
    if x and (x == true or not raw[x]) and not loud[key] then
      -- Marked, and kept a second past its end, so the first decision of
      -- the key's next window still finds the mark (its count then
      -- starts at 0 as the window's does, and no G:x is read).
      f2, f3, px = '0%.0f %.0f', '0%.0f %.0f %.0f', px + MARK_KEEP_MS
    end
    local v
    if s[3] then
      v = string.format(f3, s[1], s[2], s[3])
    else
      v = string.format(f2, s[1], s[2])
    end
    redis.call('SET', key, v, 'PX', px)
  end
end

-- Set a hash state's expiry the same way.
local function expire(key, ttl_us)
  redis.call('PEXPIRE', key, int(math.floor(math.max(ttl_us, 0) / 1000) + TTL_SLACK_MS))
end

-- The numbers of a space-separated string state of two or three numbers
-- (n), or nil when the state is missing or not of that shape. One anchored
-- match, not a word iterator, and once per key per call. The table is the
-- cache's: read it, never change it.
local function numbers(key, n)
  local s = cached[key]
  if s == nil then
    s = false
    local v = raw[key]
    if v == nil then v = redis.call('GET', key) end
    if v then
      if n == 2 then
        local a, b = string.match(v, '^(%d+) (%d+)$')
        if a then s = { tonumber(a), tonumber(b) } end
      else
        local a, b, c = string.match(v, '^(%d+) (%d+) (%d+)$')
        if a then s = { tonumber(a), tonumber(b), tonumber(c) } end
      end
    end
    cached[key] = s
  end
  if not s or (s[3] ~= nil) ~= (n == 3) then return nil end
  return s
end
