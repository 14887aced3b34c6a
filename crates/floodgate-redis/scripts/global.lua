-- global.lua: a Redis region's `scope: global` limits (see docs/regions.md,
-- "A Redis region"). Loaded after the algorithms, before entry.lua, which
-- calls these for checks whose scope is global and for the ops `merge`,
-- `read` and `ack`.
--
-- Keys, beside a check's state key S = <prefix>{tag}<rest>:<fingerprint>
-- (this region's own counts, as for a regional check), all in S's hash
-- slot. G = <prefix>{tag}<rest>:g is their base:
--   G:m          a hash: the rule this region decides the key with (S
--                state key, C algorithm code, L limit, W window, B burst or
--                granularity, F fingerprint) and the key's shape (K kind
--                1 window counts / 2 gcra, U slot length us, H horizon), and
--                GCRA debt that came before the rule (p hits, ps since).
--   G:<slot>     a hash per slot: c:<region>:<incarnation> = a peer's (or an
--                earlier incarnation's) count; o = this region's own count
--                (GCRA family only: the window algorithms' own counts are in
--                S); a:<peer> = the largest own count that peer acknowledged
--                (bounded rules). It expires when the slot no longer counts.
--   G:x          a string "<fingerprint> <due> <keep>;<slot> <total> ...":
--                the rule G:m holds (0: none yet), when G:m's expiry is next
--                due for refreshing, until when (us) G:x itself must stay
--                (both 16 digits, so a decision reads them without a
--                pattern),
--                then the peers' sum per slot that still counts (kept by
--                the merge). The one thing a global decision reads beyond a
--                regional one, named by the caller and read in the call's
--                one MGET: no extra Redis command in the common case.
--   G:r          a string "<fingerprint> <due>": the rule a read recorded on
--                G:m and when that record is due again (grecord), so the
--                sync's read of a batch fetches every key's in one MGET.
--   G:b          a string "<slot> <given back> ...": this region's own hits
--                given back (refunds) per slot that still counts, never
--                decreasing; absent until a refund. The window algorithms'
--                state S counts net of them, so what this region took in a
--                slot is S's count plus G:b's; the GCRA family's `o`
--                fields count what it took. Peers' given-back counts are
--                k:<region>:<incarnation> fields beside their c: fields.
--                A component counts taken - given back (never below 0).
--
-- Who records the rule on G:m: for the GCRA family, the decision (a merge
-- pours a peer's debt into the bucket at once, which needs the rule), so
-- its G:x stays while the key is decided. For the window algorithms a
-- merge needs no rule (the peers' counts go to G:x), so a decision whose
-- key has no G:x (no peer sent a count that still counts, the common case)
-- does nothing beyond a regional one: the sync's read records the rule
-- instead (`read` with the rule given, at most a lazy period after the
-- key's first admitted hit), and G:x lives only as long as peers' counts.

-- The base G of a state key: the fingerprint suffix replaced by `g`.
local bases = {}
local function gbase(key)
  local g = bases[key]
  if not g then
    -- Every state key ends in ':' and 8 hex digits (script.rs); a cut,
    -- not a pattern search, as this runs for every global check.
    if string.byte(key, -9) == 58 then
      g = string.sub(key, 1, -10) .. ':g'
    else
      g = key .. ':g'
    end
    bases[key] = g
  end
  return g
end

local function gslot(g, slot)
  return g .. ':' .. int(slot)
end

-- Keep G:<slot> until the slot stops counting: the end of slot + horizon.
local function gslot_expire(g, slot, u, h, now)
  local ttl = (slot + h) * u - now
  expire(gslot(g, slot), math.max(ttl, u))
end

-- The totals of G:x's text v from position `at`: slot -> total.
local function xtotals(v, at)
  local t = {}
  if at <= #v then
    for slot, total in string.gmatch(string.sub(v, at), '(%d+) (%d+)') do
      t[tonumber(slot)] = tonumber(total)
    end
  end
  return t
end

-- G:x parsed (cached per call): {fp, due, keep, t = slot -> total}.
local xs = {}
local function xentry(x)
  local e = xs[x]
  if e == nil then
    e = { fp = '0', due = 0, keep = 0, t = {} }
    local v = fetched(x)
    if v then
      local fp, due, keep, at = string.match(v, '^(%d+) (%d+) (%d+);()')
      if fp then
        e.fp, e.due, e.keep, e.t = fp, tonumber(due), tonumber(keep), xtotals(v, at)
      end
    end
    xs[x] = e
  end
  return e
end

-- The peers' totals of G:x for a decision whose rule has fingerprint fp, if
-- G:m holds that rule and needs no refresh yet; else nil. The common case
-- of every global decision: a prefix compare and one number, no pattern
-- (and no table at all when the peers have sent nothing that counts).
local NONE = {}
local function xfast(x, fp, now)
  local e = xs[x]
  if e then
    if e.fp == fp and e.due > now then return e.t end
    return nil
  end
  local v = fetched(x)
  local n = #fp
  if not v or string.byte(v, n + 1) ~= 32 or string.sub(v, 1, n) ~= fp then return nil end
  local due = tonumber(string.sub(v, n + 2, n + 17))
  if not due or due <= now then return nil end
  if #v <= n + 35 then return NONE end
  e = { fp = fp, due = due, keep = tonumber(string.sub(v, n + 19, n + 34)) or 0, t = xtotals(v, n + 36) }
  xs[x] = e
  return e.t
end

-- Write G:x back: the slots that still count at `now`; kept until the last
-- of them stops counting, or until `keep`, whichever is later.
local function xput(x, e, u, h, now)
  local cur = divmod(now, u)
  local parts, ttl = {}, e.keep - now
  for slot, total in pairs(e.t) do
    if slot + h <= cur or total <= 0 then
      e.t[slot] = nil
    else
      parts[#parts + 1] = int(slot) .. ' ' .. int(total)
      ttl = math.max(ttl, (slot + h) * u - now)
    end
  end
  if ttl <= 0 then
    redis.call('DEL', x)
    raw[x] = false
    return
  end
  local v = e.fp .. string.format(' %016.0f %016.0f;', e.due, e.keep) .. table.concat(parts, ' ')
  raw[x] = v
  redis.call('SET', x, v, 'PX', int(math.floor(ttl / 1000) + TTL_SLACK_MS))
end

-- max(tat, at) + hits * window / limit, on the GCRA state key.
local function gcra_debt(key, l, w, hits, at)
  local s = numbers(key, 2)
  local us, rem = 0, 0
  if s then us, rem = s[1], s[2] end
  if us < at then us, rem = at, 0 end
  local ku, kr = muldivmod(hits, w, 0, l)
  us, rem = tadd(us, rem, ku, kr, l)
  local ttl = us - at
  if rem > 0 then ttl = ttl + 1 end
  put(key, ttl, us, rem)
end

-- A GCRA key's crash debts (spec D: "<dead us>:<hits>,..."): each poured
-- once, dated at the death; G:m's field d is the latest death poured.
local function gdebts(key, l, w, debts)
  local m = gbase(key) .. ':m'
  local seen = tonumber(redis.call('HGET', m, 'd')) or 0
  local last = seen
  for at, hits in string.gmatch(debts, '(%d+):(%d+)') do
    at = tonumber(at)
    if at > seen then
      gcra_debt(key, l, w, tonumber(hits), at)
      if at > last then last = at end
    end
  end
  if last > seen then redis.call('HSET', m, 'd', int(last)) end
end

-- This region's own counts per slot over the slots that count at `now`:
-- {slot, count} pairs. Window algorithms: from the state key; the GCRA
-- family: the `o` fields.
local function own_slots(key, g, code, w, p, u, h, now)
  local out = {}
  if code == 'fw' then
    local s = numbers(key, 2)
    if s and s[2] > 0 then out[1] = { s[1], s[2] } end
  elseif code == 'sw' then
    local s = numbers(key, 3)
    if s then
      if s[2] > 0 then out[#out + 1] = { s[1] - 1, s[2] } end
      if s[3] > 0 then out[#out + 1] = { s[1], s[3] } end
    end
  elseif code == 'sb' then
    local last = tonumber(redis.call('HGET', key, 'l'))
    if last then
      local fields, ids = {}, {}
      for id = math.max(last + 1 - p, 0), last do
        fields[#fields + 1] = int(math.fmod(id, p))
        ids[#ids + 1] = id
      end
      local raw = redis.call('HMGET', key, unpack(fields))
      for i = 1, #ids do
        local c = tonumber(raw[i]) or 0
        if c > 0 then out[#out + 1] = { ids[i], c } end
      end
    end
  else
    local cur = divmod(now, u)
    for slot = math.max(cur + 1 - h, 0), cur do
      local c = tonumber(redis.call('HGET', gslot(g, slot), 'o')) or 0
      if c > 0 then out[#out + 1] = { slot, c } end
    end
  end
  return out
end

-- This region's own hits given back, per slot (G:b): slot -> hits.
local function gbacks(g)
  local t = {}
  local v = fetched(g .. ':b')
  if v then
    for slot, back in string.gmatch(v, '(%d+) (%d+)') do t[tonumber(slot)] = tonumber(back) end
  end
  return t
end

-- Add `given` to G:b's `slot`; slots that no longer count at `now` go, and
-- G:b stays until the last of the rest stops counting.
local function gback_add(g, slot, given, u, h, now)
  local t = gbacks(g)
  t[slot] = (t[slot] or 0) + given
  local cur = divmod(now, u)
  local slots, ttl = {}, 0
  for s, b in pairs(t) do
    if s + h > cur and b > 0 then
      slots[#slots + 1] = s
      ttl = math.max(ttl, (s + h) * u - now)
    end
  end
  local x = g .. ':b'
  -- The key's record (G:r) says it has given back: read it by the script.
  local r = fetched(g .. ':r')
  if r and string.sub(r, -2) ~= ' b' then
    redis.call('DEL', g .. ':r')
    raw[g .. ':r'] = false
  end
  if #slots == 0 then
    redis.call('DEL', x)
    raw[x] = false
    return
  end
  table.sort(slots)
  local parts = {}
  for _, s in ipairs(slots) do parts[#parts + 1] = int(s) .. ' ' .. int(t[s]) end
  local v = table.concat(parts, ' ')
  raw[x] = v
  redis.call('SET', x, v, 'PX', int(math.floor(ttl / 1000) + TTL_SLACK_MS))
end

-- This region's own counts per slot that counts at `now`, with what it
-- gave back: {slot, taken, given back}, as a memory region keeps them (the
-- window algorithms' state counts net of refunds: taken = state + given
-- back; the GCRA family's `o` fields count what was taken).
local function own_taken(key, g, code, w, p, u, h, now)
  local backs = gbacks(g)
  local gcra = code == 'gc' or code == 'sh'
  local cur = divmod(now, u)
  local out, seen = {}, {}
  for _, sc in ipairs(own_slots(key, g, code, w, p, u, h, now)) do
    local b = backs[sc[1]] or 0
    local taken = sc[2]
    if not gcra then taken = taken + b end
    out[#out + 1] = { sc[1], taken, b }
    seen[sc[1]] = true
  end
  for s, b in pairs(backs) do
    if not seen[s] and s + h > cur and s <= cur then
      local taken = 0
      if not gcra then taken = b end
      out[#out + 1] = { s, taken, b }
    end
  end
  return out
end

-- G:m (and G:r, or a GCRA key's G:x) stay at least this long (us) after
-- the decision or read that recorded the rule, so a key decided often is
-- recorded again at most every minute however short its window (each
-- costs a few commands); the price is ~300 bytes per key kept up to two
-- minutes after its last use.
local META_MIN_US = 120000000

-- Write the rule on G:m (m) with a life of ttl (us), and pour in a GCRA
-- key's debt that came before the rule (kind 2).
local function grule(m, key, code, l, w, p, fp, kind, u, h, ttl, now)
  redis.call('HSET', m, 'S', key, 'C', code, 'L', int(l), 'W', int(w), 'B', int(p), 'F', fp,
    'K', kind, 'U', int(u), 'H', int(h))
  if kind == 2 then
    local pend = redis.call('HMGET', m, 'p', 'ps')
    local hits, since = tonumber(pend[1]), tonumber(pend[2])
    if hits and hits > 0 then
      gcra_debt(key, l, w, hits, since or now)
      redis.call('HDEL', m, 'p', 'ps')
    end
  end
  expire(m, ttl)
end

-- Record the rule on G:m (what a merge needs to pour GCRA debt, and the
-- shape), and drain debt that came before it. Every global decision comes
-- here, so the common case only looks at G:x, already fetched: the same
-- fingerprint (which names the state key and covers the rest) and G:m's
-- expiry refreshed less than half its time ago. Returns the peers' totals
-- (slot -> total).
local function gmeta(x, key, code, l, w, p, fp, u, h, now)
  -- (entry.lua calls this for a window algorithm's key only when it has a
  -- G:x: with none, there is nothing to read or record here; the sync's
  -- read records the rule.)
  local kind = 1
  if code == 'gc' or code == 'sh' then kind = 2 end
  local t = xfast(x, fp, now)
  if t then return t end
  local e = xentry(x)
  if e.fp == fp and e.due > now then return e.t end
  local m = gbase(key) .. ':m'
  local ttl = math.max((h + 2) * u + w, META_MIN_US)
  -- G:x stays past its peers' counts only for the GCRA family (its
  -- presence is how a decision knows the rule is recorded).
  local keep = now + ttl
  if kind == 1 then keep = 0 end
  -- The same rule, only due: G:m needs a longer life, nothing else (when
  -- it is still there: else it is written again).
  if e.fp == fp and redis.call('PEXPIRE', m, int(math.floor(ttl / 1000) + TTL_SLACK_MS)) == 1 then
    e.due, e.keep = now + math.floor(ttl / 2), keep
    xput(x, e, u, h, now)
    return e.t
  end
  grule(m, key, code, l, w, p, fp, kind, u, h, ttl, now)
  e.fp, e.due, e.keep = fp, now + math.floor(ttl / 2), keep
  xput(x, e, u, h, now)
  return e.t
end

-- A global check, after its algorithm admitted `hits` (own state already
-- updated): count GCRA hits per slot, then the caps (bounded slice, and
-- the warming cap). Returns nil when within them, else the denial's
-- remaining and retry (the hits given back). A late charge (`late`) is
-- counted and never capped: it cannot be refused. (Here the slice counts
-- it among the own hits not yet acknowledged, which only makes the
-- admissions after it stricter until peers acknowledge it; a memory region
-- keeps it apart.)
local function gcommit(key, code, l, w, p, hits, now, spec, alg, before, late)
  local u, h, slice, peers, warm, retry_us = spec[1], spec[2], spec[3], spec[4], spec[5], spec[6]
  local gcra = code == 'gc' or code == 'sh'
  if not gcra and slice == 0 and warm == 0 and spec[8] ~= 1 then return nil end
  local g = gbase(key)
  local cur = divmod(now, u)
  if gcra then
    redis.call('HINCRBY', gslot(g, cur), 'o', int(hits))
    gslot_expire(g, cur, u, h, now)
  end
  if late then
    -- Kept apart from the admitted hits where a cap reads them.
    if slice > 0 or warm > 0 or spec[8] == 1 then
      redis.call('HINCRBY', gslot(g, cur), 'l', int(hits))
      gslot_expire(g, cur, u, h, now)
    end
    return nil
  end
  if slice == 0 and warm == 0 and spec[8] ~= 1 then return nil end
  -- What this region admitted at request time: taken less the late
  -- charges (field l), which the slice does not bound. A peer's
  -- acknowledgement of taken count a:<peer> acknowledged the admitted hits
  -- a - L:<peer>, L the late charges when it came (at least those the
  -- acknowledged read saw: stricter, never looser, than a memory region,
  -- which notes the admitted count as it sends).
  local own, unacked = 0, 0
  for _, sc in ipairs(own_taken(key, g, code, w, p, u, h, now)) do
    local fields = { 'l' }
    if slice > 0 then
      for i = 0, peers - 1 do
        fields[#fields + 1] = 'a:' .. i
        fields[#fields + 1] = 'L:' .. i
      end
    end
    local v = redis.call('HMGET', gslot(g, sc[1]), unpack(fields))
    local admitted = math.max(sc[2] - (tonumber(v[1]) or 0), 0)
    own = own + admitted
    if slice > 0 then
      local least = admitted
      for i = 1, peers do
        least = math.min(least, (tonumber(v[2 * i]) or 0) - (tonumber(v[2 * i + 1]) or 0))
      end
      unacked = unacked + (admitted - math.max(least, 0))
    end
  end
  local left, whole = nil, 0
  if slice > 0 then left, whole = slice - unacked, slice end
  if warm > 0 then
    local wl = warm - own
    if left == nil or wl < left then left = wl end
    if whole == 0 then whole = warm end
  end
  if spec[8] == 1 then
    -- Closed: nothing beyond the algorithm's answer.
    left = -hits
    if whole == 0 then whole = math.max(slice, warm) end
  end
  if left == nil or left >= 0 then return nil end
  -- Over: undo (the state exactly as before: a GCRA refund would leave a
  -- tat clamped up to now) and deny.
  if gcra then
    put(key, math.max(before[1] - now, 0), before[1], before[2])
    redis.call('HINCRBY', gslot(g, cur), 'o', int(-hits))
  else
    alg.refund(key, l, w, p, hits, now, now)
  end
  local retry = -1
  if hits <= whole then retry = retry_us end
  return math.max(left + hits, 0), retry
end

-- A refund of a global check at `now` (Limit::give_back on this region's
-- own state), recorded as own hits given back (G:b), which the read sends
-- to peers beside the hits taken: they give back as much. Never more than
-- this region took: the window algorithms' state is its own counts (given
-- back newest first, never below zero); the GCRA family's bucket holds the
-- peers' debt too, so its refund is capped at this region's own hits in
-- the slots it keeps, and recorded in the current slot.
-- With `taken_at`, a return (Limit::refund of hits taken then: the window
-- algorithms give back from that slot, if it still counts; the GCRA family
-- as a refund now, as a memory region does).
local function ggive_back(key, code, alg, l, w, p, hits, now, spec, taken_at)
  local u, h = spec[1], spec[2]
  local g = gbase(key)
  if code == 'gc' or code == 'sh' then
    local own = 0
    for _, sc in ipairs(own_taken(key, g, code, w, p, u, h, now)) do own = own + sc[2] - sc[3] end
    local given = math.min(hits, math.max(own, 0))
    if given > 0 then
      alg.give_back(key, l, w, p, given, now)
      gback_add(g, divmod(now, u), given, u, h, now)
    end
    return
  end
  local before = own_slots(key, g, code, w, p, u, h, now)
  if taken_at then
    alg.refund(key, l, w, p, hits, taken_at, math.max(now, taken_at))
  else
    alg.give_back(key, l, w, p, hits, now)
  end
  local after = {}
  for _, sc in ipairs(own_slots(key, g, code, w, p, u, h, now)) do after[sc[1]] = sc[2] end
  for _, sc in ipairs(before) do
    local d = sc[2] - (after[sc[1]] or 0)
    if d > 0 then gback_add(g, sc[1], d, u, h, now) end
  end
end

-- Give back a global GCRA check's per-slot count (the request was denied
-- elsewhere: all or nothing).
local function grefund(key, code, hits, at, spec)
  if code ~= 'gc' and code ~= 'sh' then return end
  local slot = divmod(at, spec[1])
  local f = gslot(gbase(key), slot)
  local c = tonumber(redis.call('HGET', f, 'o')) or 0
  if c > 0 then redis.call('HSET', f, 'o', int(math.max(c - hits, 0))) end
end

-- A window key's state S no longer marked "no peers' counts" (lib.lua,
-- `marked`): its G:x now holds some. Its expiry stays (PTTL, not KEEPTTL:
-- Redis before 6 has none). (pcall: a name that is not a string state
-- changes nothing.)
local function gunmark(s)
  local v = redis.pcall('GET', s)
  if type(v) == 'string' and marked(v) then
    local ttl = redis.call('PTTL', s)
    if ttl > 0 then
      redis.call('SET', s, string.sub(v, 2), 'PX', ttl)
    else
      redis.call('SET', s, string.sub(v, 2))
    end
  end
end

-- merge: peers' components into this region. KEYS: the items' bases G.
-- ARGV after the op: now ('' for TIME), this region's name and
-- incarnation, the sender's name and incarnation, then per item: kind,
-- slot us, horizon, fingerprint, the state key S this region decides the
-- key's rule with, when the caller knows it (its window algorithms'; ''
-- otherwise), n, and n x (region, incarnation, slot, count, given back).
-- Returns merged, unchanged, stale, mismatched, then the positions
-- (1-based) of the items in which a component the sender relays (not its
-- own current one) raised this region's: to send on to the other peers.
-- A window key whose G:x holds peers' counts afterwards has its states
-- unmarked: the one named, and the one G:m records (a rule the caller did
-- not know, as while two regions' rules differ, once a read recorded it).
local function gmerge(now)
  local me, my_inc, from, from_inc = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  local merged, unchanged, stale, mismatched = 0, 0, 0, 0
  local relay = {}
  local a = 7
  for i = 1, #KEYS do
    local g = KEYS[i]
    local kind, u, h, fp, state, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), ARGV[a + 3],
      ARGV[a + 4], tonumber(ARGV[a + 5])
    a = a + 6
    local m = g .. ':m'
    local meta = redis.call('HMGET', m, 'K', 'U', 'H', 'F', 'S', 'L', 'W', 'C', 'B')
    local skip = false
    if meta[1] and (tonumber(meta[1]) ~= kind or tonumber(meta[2]) ~= u or tonumber(meta[3]) ~= h) then
      -- Counts that mean something else here: not merged.
      mismatched = mismatched + 1
      skip = true
    elseif meta[4] and fp ~= '0' and meta[4] ~= fp then
      mismatched = mismatched + 1
    end
    if not meta[1] and not skip then
      redis.call('HSET', m, 'K', kind, 'U', int(u), 'H', int(h))
      expire(m, (h + 2) * u)
    end
    local x = g .. ':x'
    local e = xentry(x)
    local changed = false
    if not meta[5] and not skip and e.fp ~= '0' then
      -- G:m has no rule: the next decision must write it (and drain debt).
      e.fp, e.due = '0', 0
      changed = true
    end
    local cur = divmod(now, u)
    local t = e.t
    local relayed = false
    for _ = 1, n do
      local region, inc, slot, count, back = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
        tonumber(ARGV[a + 4])
      a = a + 5
      if skip then
        -- not merged
      elseif region == me and inc == my_inc then
        unchanged = unchanged + 1
      elseif slot + h <= cur then
        stale = stale + 1
      else
        local f = gslot(g, slot)
        local field, kfield = 'c:' .. region .. ':' .. inc, 'k:' .. region .. ':' .. inc
        local olds = redis.call('HMGET', f, field, kfield)
        local old, oldb = tonumber(olds[1]) or 0, tonumber(olds[2]) or 0
        if count > old or back > oldb then
          local delta, given = math.max(count - old, 0), math.max(back - oldb, 0)
          if delta > 0 then redis.call('HSET', f, field, int(count)) end
          if given > 0 then redis.call('HSET', f, kfield, int(back)) end
          -- The component counts taken - given back, never below zero.
          local net = math.max(math.max(count, old) - math.max(back, oldb), 0) - math.max(old - oldb, 0)
          t[slot] = (t[slot] or 0) + net
          changed = true
          gslot_expire(g, slot, u, h, now)
          merged = merged + 1
          if region ~= from or inc ~= from_inc then relayed = true end
          if kind == 2 then
            local key, l, w = meta[5], tonumber(meta[6]), tonumber(meta[7])
            local known = key and l and w and l > 0
            if delta > 0 then
              local at = math.min(now, (slot + 1) * u)
              if known then
                gcra_debt(key, l, w, delta, at)
              else
                redis.call('HINCRBY', m, 'p', int(delta))
                local since = tonumber(redis.call('HGET', m, 'ps'))
                if not since or at < since then redis.call('HSET', m, 'ps', int(at)) end
              end
            end
            if given > 0 then
              -- Given back in the peer's bucket: given back in this one
              -- (after the debt, when both came).
              if known and ALG[meta[8]] then
                ALG[meta[8]].refund(key, l, w, tonumber(meta[9]) or 0, given, now, now)
              else
                -- All of it given back: nothing pending, and the next
                -- debt starts when it comes (as a memory region's does).
                local pend = tonumber(redis.call('HGET', m, 'p')) or 0
                if pend > given then
                  redis.call('HSET', m, 'p', int(pend - given))
                elseif pend > 0 then
                  redis.call('HDEL', m, 'p', 'ps')
                end
              end
            end
          end
        else
          unchanged = unchanged + 1
        end
      end
    end
    if changed then xput(x, e, u, h, now) end
    if kind == 1 and raw[x] then
      if state ~= '' then gunmark(state) end
      if meta[5] and meta[5] ~= state and (meta[8] == 'fw' or meta[8] == 'sw') then gunmark(meta[5]) end
    end
    if relayed then relay[#relay + 1] = i end
  end
  local out = { merged, unchanged, stale, mismatched }
  for _, i in ipairs(relay) do out[#out + 1] = i end
  return out
end

-- The rule a read was given, parsed (once per call per rule): {code, l,
-- w, p, fp, kind, u, h}, or false for a malformed one.
local rspecs = {}
local function rspec(spec)
  local r = rspecs[spec]
  if r == nil then
    r = false
    local code, l, w, p, fp, kind, u, h = string.match(spec, '^(%a+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
    if code then r = { code, tonumber(l), tonumber(w), tonumber(p), fp, kind, tonumber(u), tonumber(h) } end
    rspecs[spec] = r
  end
  return r
end

-- Record a window algorithm's rule r (rspec) a read was given on G:m (what
-- merges and acknowledgements read; the key's decisions leave it to the
-- read), and beside it G:r, the string "<fingerprint> <due>": the rule
-- recorded and when G:m's expiry is next due for refreshing. The read
-- fetches every key's G:r in one MGET, so a key read every interval costs
-- no Redis command here until its record is due (half its life); then G:m
-- is written again. (Not for the GCRA family: its decisions record its
-- rule, and pour the debt that came before it exactly when a memory
-- region would; the read pouring it earlier changed later answers, as
-- a_redis_region_decides_as_a_memory_region found.)
local function grecord(g, key, r, now)
  local code, l, w, p, fp, kind, u, h = r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]
  local held = fetched(g .. ':r')
  local n = #fp
  if held and string.byte(held, n + 1) == 32 and string.sub(held, 1, n) == fp
    and (tonumber(string.match(held, '^%d+', n + 2)) or 0) > now then
    return
  end
  local m = g .. ':m'
  local ttl = math.max((h + 2) * u + w, META_MIN_US)
  grule(m, key, code, l, w, p, fp, tonumber(kind), u, h, ttl, now)
  -- A key that gave hits back (G:b) is marked " b": the caller's plain
  -- MGET then reads it through this script, which sends what it gave back.
  local mark = ''
  if fetched(g .. ':b') then mark = ' b' end
  redis.call('SET', g .. ':r', fp .. ' ' .. int(now + math.floor(ttl / 2)) .. mark, 'PX',
    int(math.floor(ttl / 1000) + TTL_SLACK_MS))
end

-- read: what this region holds for each key, to send to a peer. KEYS: the
-- bases G. ARGV after the op: now, full (1: every component of every key;
-- 0: as each key's own flag says), then per key its state key S, "C L W B F K U H"
-- (the rule, as G:m holds it; both '' when the caller does not know the
-- rule: then G:m's is used) and its own full flag (1: every component of
-- this key, which this region relays). Returns per key: fingerprint, kind, slot us, horizon
-- (kind 0: nothing known), n, then n x (region, incarnation, slot, count,
-- given back); region '' is this region's current incarnation. Except,
-- for a key read with its rule, of fixed_window or sliding_window, not
-- full, that never gave back (no G:b): '=' and its state string ('' when
-- missing), which the caller reads as the own counts (as own_slots does
-- here): the common case of every batch, with no Redis command and no
-- table made per key.
local function gread(now)
  local every = ARGV[3] == '1'
  local out = {}
  -- Every given rule's G:r and string state, in one MGET.
  local rules, fetch = {}, {}
  for i = 1, #KEYS do
    local key, spec = ARGV[1 + 3 * i], ARGV[2 + 3 * i]
    if key and key ~= '' then
      local r = rspec(spec)
      if r then
        rules[i] = r
        if r[6] == '1' then fetch[#fetch + 1] = KEYS[i] .. ':r' end
        if r[1] == 'fw' or r[1] == 'sw' then
          fetch[#fetch + 1] = key
          fetch[#fetch + 1] = KEYS[i] .. ':b'
        end
      end
    end
  end
  prefetch(fetch)
  for i = 1, #KEYS do
    local g = KEYS[i]
    local r, meta = rules[i], nil
    local full = every or ARGV[3 + 3 * i] == '1'
    if r then
      local key = ARGV[1 + 3 * i]
      -- A GCRA key's rule is its decisions' to record (they pour the debt
      -- that came before it, as a memory region does): read by it only.
      if r[6] == '1' then grecord(g, key, r, now) end
      if not full and (r[1] == 'fw' or r[1] == 'sw') and not fetched(g .. ':b') then
        out[#out + 1] = '='
        out[#out + 1] = fetched(key) or ''
      else
        meta = { r[5], r[6], r[7], r[8], key, r[1], r[3], r[4] }
      end
    else
      meta = redis.call('HMGET', g .. ':m', 'F', 'K', 'U', 'H', 'S', 'C', 'W', 'B')
    end
    local kind, u, h
    if meta then kind, u, h = tonumber(meta[2]), tonumber(meta[3]), tonumber(meta[4]) end
    if not meta then
      -- answered above
    elseif not kind or not u or not h then
      out[#out + 1] = '0'; out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0; out[#out + 1] = 0
    else
      local comps = {}
      if meta[5] then
        for _, sc in ipairs(own_taken(meta[5], g, meta[6], tonumber(meta[7]), tonumber(meta[8]), u, h, now)) do
          comps[#comps + 1] = { '', '', sc[1], sc[2], sc[3] }
        end
      end
      if full then
        local cur = divmod(now, u)
        for slot = math.max(cur + 1 - h, 0), cur do
          local kv = redis.call('HGETALL', gslot(g, slot))
          -- Each peer's (or earlier incarnation's) taken (c:) and given
          -- back (k:); either may be alone.
          local by, names = {}, {}
          for j = 1, #kv, 2 do
            local what, region, inc = string.match(kv[j], '^([ck]):(.*):(%d+)$')
            if what then
              local name = region .. ':' .. inc
              local c = by[name]
              if not c then
                c = { region, inc, slot, 0, 0 }
                by[name] = c
                names[#names + 1] = name
              end
              if what == 'c' then c[4] = tonumber(kv[j + 1]) else c[5] = tonumber(kv[j + 1]) end
            end
          end
          for _, name in ipairs(names) do comps[#comps + 1] = by[name] end
        end
      end
      out[#out + 1] = meta[1] or '0'
      out[#out + 1] = kind; out[#out + 1] = u; out[#out + 1] = h; out[#out + 1] = #comps
      for _, c in ipairs(comps) do
        out[#out + 1] = c[1]; out[#out + 1] = c[2]; out[#out + 1] = c[3]; out[#out + 1] = c[4]
        out[#out + 1] = c[5]
      end
    end
  end
  return out
end

-- ack: a peer acknowledged own counts. KEYS: the bases G. ARGV after the
-- op: now, the peer's index, then per key: n, n x (slot, count).
local function gack(now)
  local field = 'a:' .. ARGV[3]
  local a = 4
  for i = 1, #KEYS do
    local n = tonumber(ARGV[a])
    a = a + 1
    local meta = redis.call('HMGET', KEYS[i] .. ':m', 'U', 'H')
    local u, h = tonumber(meta[1]), tonumber(meta[2])
    for _ = 1, n do
      local slot, count = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
      a = a + 2
      if u and h then
        local f = gslot(KEYS[i], slot)
        local v = redis.call('HMGET', f, field, 'l')
        local old = tonumber(v[1]) or 0
        if count > old then
          -- With the late charges so far (see gcommit).
          redis.call('HSET', f, field, int(count), 'L:' .. ARGV[3], int(tonumber(v[2]) or 0))
          gslot_expire(KEYS[i], slot, u, h, now)
        end
      end
    end
  end
  return 1
end
