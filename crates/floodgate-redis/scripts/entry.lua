-- entry.lua: decides one or more requests in one call, each request's
-- limits all or nothing. Loaded after lib.lua and the algorithms.
--
-- A call carries a batch: the store sends the requests that arrive while
-- its previous call is in flight together (one server), or one request's
-- limits in one hash slot (Redis Cluster: every key of a call must share a
-- slot). Requests are decided in order, each seeing the ones before it.
--
-- KEYS         the counter keys of every check of every request, in order.
-- ARGV[1]      "apply" or "refund" (or, for a region's global limits, see
--              global.lua: "merge", "read" or "ack", with their own KEYS and
--              ARGV).
-- Then per request:
--   now        microseconds since the Unix epoch, or "" to read the Redis
--              server's TIME (the default: instances with skewed clocks
--              still agree). With a given time, keys expire an hour late
--              (Redis expires them on its own clock).
--   n          the number of its checks (its next n keys).
--   8 values per check: algorithm (fw fixed_window, sl sliding_log, sw
--              sliding_window, sb sliding_buckets, gc gcra / token_bucket /
--              leaky_bucket meter, sh leaky_bucket shaper), limit, window
--              (us), burst or granularity (0 when the algorithm takes
--              neither), hits (at most capacity + 1: every larger request
--              is denied alike), and for "apply" 1 when a denial denies the
--              request (0 for a shadow-mode limit; 2 for a refund, which
--              gives `hits` back and answers as a peek; plus 4 for a limit
--              charged after the work: hits >= 1 a late charge, never
--              denied and never undone, hits 0 the gate, denied once a
--              request of one hit would be; 4 alone for a late charge on
--              any limit; a time of 2^32 us or more for a return of hits
--              taken then, as if never taken, answered as a refund is),
--              for "refund" the time the hits were taken; then the scope ('' regional, else a
--              global check's G:x key, global.lua: named by the caller, as
--              a string made in Lua costs more than the argument; '=' for a
--              quiet check, whose G:x the script names only when its state
--              is unmarked, below) and for
--              a global check "U H S P W R F": its slot
--              length (us) and horizon, the bounded slice (0: none), the
--              number of peers, the warming cap (0: none), the retry time
--              of a capped denial (us), the limit's fingerprint. A
--              concurrency check (cc, never global: scope '') has its
--              lease operation there instead: '' (hits as any algorithm
--              takes them: an anonymous lease), "a<id>" acquire as lease
--              <id> (16 hex digits), "r<id>" release it, "r" release the
--              earliest-expiring lease, "e<id>" extend it
--              (concurrency.lua).
--
-- "apply" decides each request's checks in order; when an enforced check is
-- denied, the request's checks that allowed are refunded at once (which
-- leaves no trace), so the request takes nothing anywhere. It returns, per
-- request: now, denied (1/0), then per check: allowed (1/0), remaining,
-- reset_after (us), retry_after (us, -1 for none), delay (us; for a
-- concurrency check what it did to the slots instead: cc_account).
-- "refund" gives the hits back (a request whose other limits, in another
-- slot, denied it) and returns, per request: now.
--
-- Reservations (floodgate_core::reservation): a request's `now` may carry
-- a mode, so reserves and settles go in the batches with decisions:
--   "r<now>|<id>|<kept us> <ttl us of each check>|<description>": a
--     reserve. Decided as any request; when allowed, each check that
--     allowed keeps its part beside its counter, KEYS[i]:r:<id> =
--     "<estimate> <taken at> <expires at> <kept until>" (kept: how long
--     the reservation's record lasts, whatever Redis's clock). A non-empty
--     description (for a settle through another instance) goes to one more
--     key after the request's, as "<mask>\n<description>" (mask: 1 per
--     check kept, else 0). Answered as any request.
--   "s<now>|<id>": a settle; the checks are the parts, in order, with hits
--     the actual amount. Every part unsettled: each is charged its excess
--     late (as flag 4), or given back what it did not use as if never
--     taken (a return, unless expired), then recorded as settled
--     ("=<actual> <late> <returned> <expired> <remaining> <reset> <kept
--     until>"); a record kept past its time is unknown. Every
--     part settled at the same amounts: the records answer again, nothing
--     is done. Answered: now, then 0 and per part: flags (1 again, 2
--     expired), late, returned, remaining, reset (us); or 2 and zeros (a
--     part unknown); or 3 and per part its settled amount then zeros
--     (settled at another amount: a conflict). All of a request's parts or
--     none.

local op = ARGV[1]
local refunding = op == 'refund'
if op == 'merge' or op == 'read' or op == 'ack' then
  local now
  if ARGV[2] == '' then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  else
    now = tonumber(ARGV[2])
    TTL_SLACK_MS = 3600000
  end
  local out
  if op == 'merge' then out = gmerge(now) elseif op == 'read' then out = gread(now) else out = gack(now) end
  flush()
  return out
end
if not refunding and op ~= 'apply' then
  return redis.error_reply('floodgate: ARGV[1] must be apply, refund, merge, read or ack, not ' .. tostring(op))
end

local STRIDE = 8

-- The server's time, read at most once per call.
local server_now
local function time_now()
  if not server_now then
    local t = redis.call('TIME')
    server_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return server_now
end

local function bad(why)
  return redis.error_reply('floodgate: ' .. why)
end

-- Check the shape of the whole batch before changing anything, and list
-- its string-state keys (algorithms marked `string`) to read in one MGET.
-- A request's `now` argument: its time ('' for TIME) and its mode: nil, or
-- { 'r', id, ttls, description } or { 's', id }; nil, nil when malformed.
local function header(h)
  local c = string.byte(h, 1)
  if c == 114 then
    local t, id, ttls, desc = string.match(h, '^r(%d*)|(%x+)|([%d ]*)|(.*)$')
    if not t then return nil, nil end
    return t, { 'r', id, ttls, desc }
  elseif c == 115 then
    local t, id = string.match(h, '^s(%d*)|(%x+)$')
    if not t then return nil, nil end
    return t, { 's', id }
  end
  return h, nil
end

-- Keys a request has beyond its checks' (a reserve's description).
local function extra(mode)
  if mode and mode[1] == 'r' and mode[4] ~= '' then return 1 end
  return 0
end

-- A global check's spec "U H S P W R F C Z[ D]" parsed: {{U, H, S, P, W,
-- R, C, Z, D}, F}, or false. C: hits dead incarnations may have taken
-- (window algorithms); Z: 1 to admit nothing beyond the algorithm
-- (bounded: not every peer has recorded this region's incarnation;
-- eventual: cold); D: the GCRA family's crash debts, "<dead us>:<hits>,..."
-- ('' for none). Parsed once per distinct spec per call (a batch's checks
-- mostly share a few rules).
local specs = {}
local function spec_of(text)
  local sp = specs[text]
  if sp == nil then
    local u, h, sl, pe, wa, re, fp, ch, cl, de =
      string.match(text, '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) ([01]) ?([%d:,]*)$')
    sp = false
    if u then
      sp = { { tonumber(u), tonumber(h), tonumber(sl), tonumber(pe), tonumber(wa), tonumber(re), tonumber(ch),
        tonumber(cl), de }, fp }
    end
    specs[text] = sp
  end
  return sp
end

local a, k = 2, 0
local fetch, listed = {}, {}
-- Whether a quiet check came (its state in `quiet`).
local any_quiet = false
while a <= #ARGV do
  local t, mode = header(ARGV[a])
  if not t then return bad('bad request header at ARGV[' .. a .. ']') end
  local n = tonumber(ARGV[a + 1])
  if not n or n < 1 then return bad('bad check count ' .. tostring(ARGV[a + 1]) .. ' at ARGV[' .. (a + 1) .. ']') end
  for i = 0, n - 1 do
    local code = ARGV[a + 2 + STRIDE * i]
    local alg = ALG[code]
    if not alg then return bad('unknown algorithm ' .. tostring(code) .. ' at ARGV[' .. (a + 2 + STRIDE * i) .. ']') end
    local key = KEYS[k + i + 1]
    if alg.string and key and not listed[key] then
      listed[key] = true
      fetch[#fetch + 1] = key
    end
    local x = ARGV[a + 8 + STRIDE * i]
    if code == 'cc' and not string.match(ARGV[a + 9 + STRIDE * i], '^[aer]?%x*$') then
      return bad('bad lease operation ' .. ARGV[a + 9 + STRIDE * i] .. ' at ARGV[' .. (a + 9 + STRIDE * i) .. ']')
    end
    if key and x ~= '' then
      -- Global: its G:x too (global.lua), now or once its state is read.
      -- A quiet check (G:x '=': the instance sends it for a window
      -- algorithm with a string state, an eventual rule, no warming cap, no
      -- crash charge and not closed: the common case of every global
      -- decision) reads G:x only when its state is not marked (lib.lua,
      -- `quiet`), and names it then (gbase): most never do. The others
      -- read it in the first MGET, as their caps may need it.
      if x == '=' then
        if code ~= 'fw' and code ~= 'sw' then
          return bad('a quiet global check of ' .. code .. ' at ARGV[' .. (a + 8 + STRIDE * i) .. ']: only fw and sw')
        end
        quiet[key] = true
        any_quiet = true
      else
        loud[key] = true
        if not listed[x] then
          listed[x] = true
          fetch[#fetch + 1] = x
        end
      end
    end
  end
  a, k = a + 2 + STRIDE * n, k + n + extra(mode)
end
if a ~= #ARGV + 1 or k ~= #KEYS then
  return bad('the arguments describe ' .. k .. ' checks in ' .. (a - 1) .. ' values, but ' .. #KEYS .. ' keys and ' .. #ARGV .. ' values came')
end
prefetch(fetch)
if any_quiet then
  -- A quiet check's G:x is read unless its state is marked (no peers'
  -- counts): then it is known missing, and left unnamed and unread (the
  -- decision skips it, flush marks the state again).
  local more = {}
  for s in pairs(quiet) do
    if loud[s] or not marked(raw[s]) then
      local x = gbase(s) .. ':x'
      quiet[s] = x
      if not listed[x] then
        listed[x] = true
        more[#more + 1] = x
      end
    end
  end
  if #more > 0 then prefetch(more) end
end

-- Check i of the request whose arguments start at a: its values (no table
-- per check: this runs for every decision).
local function check(a, i)
  local b = a + 2 + STRIDE * (i - 1)
  return ALG[ARGV[b]], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]),
    tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
end

-- Check i's scope: its global spec (above) and fingerprint, nil for a
-- regional check; its algorithm code and its G:x (or ''); its lease
-- operation (a concurrency check's, else nil). One call with the spec's
-- lookup inline: in Redis's Lua a call costs what a table lookup does
-- several times over, and this runs for every check.
local function scope(a, i)
  local b = a + 2 + STRIDE * (i - 1)
  local code, x = ARGV[b], ARGV[b + 6]
  if x == '' then
    if code == 'cc' and ARGV[b + 7] ~= '' then return nil, nil, code, x, ARGV[b + 7] end
    return nil, nil, code, x, nil
  end
  local text = ARGV[b + 7]
  local sp = specs[text]
  if sp == nil then sp = spec_of(text) end
  if not sp then return nil, nil, code, x, nil end
  return sp[1], sp[2], code, x, nil
end

-- A concurrency check's lease operation `lop` (see the header).
local function leased(key, l, w, hits, lop, now)
  local c, id = string.sub(lop, 1, 1), string.sub(lop, 2)
  if c == 'a' then return cc_acquire(key, l, w, hits, id, now) end
  if c == 'e' then return cc_extend(key, l, w, now, id) end
  if id == '' then id = nil end
  return cc_release(key, l, now, id)
end

-- Undo hits taken (a request denied by another limit): a lease acquired by
-- id is released.
local function refund(key, alg, l, w, p, hits, at, now, spec, code, lop)
  if l > 0 and hits > 0 and lop then
    if string.sub(lop, 1, 1) == 'a' then cc_release(key, l, math.max(now, at), string.sub(lop, 2)) end
  elseif l > 0 and hits > 0 then
    alg.refund(key, l, w, p, hits, at, math.max(now, at))
    if spec then grefund(key, code, hits, at, spec) end
  end
end

-- A decision of `hits` on key, `after`: on a limit charged after the work
-- (Charge::After). There hits >= 1 is a late charge, admitted whatever the
-- count (FORCE), and hits 0 the gate: denied once a request of one hit
-- would be. A global check's peers' counts (REMOTE) are in both.
local function charged(alg, key, l, w, p, hits, now, after)
  if not after then return alg.apply(key, l, w, p, hits, now) end
  if hits > 0 then
    FORCE = true
    local allowed, remaining, reset, retry, delay = alg.apply(key, l, w, p, hits, now)
    FORCE = false
    return allowed, remaining, reset, retry, delay
  end
  local allowed, remaining, reset, retry, delay = alg.apply(key, l, w, p, 0, now)
  if remaining == 0 then
    allowed, remaining, reset, retry, delay = alg.apply(key, l, w, p, 1, now)
  end
  return allowed, remaining, reset, retry, delay
end

local out, o = {}, 0

-- A settle's parts (the request's checks from ARGV[a], keys after k): each
-- record read, and its check made the adjustment (hits and flag). Returns
-- the parts, and nil, or 2 (a part unknown) or 3 (settled at another
-- amount), nothing changed. A part: { again (1/0), late, returned, expired
-- (1/0), remaining, reset, actual }.
-- How long a settled record is kept (µs): reservation::SETTLED_KEPT_US.
local SETTLED_KEPT_US = 60000000

local function settle_prepare(a, k, n, rid, now)
  local parts = {}
  local settled, conflict = 0, false
  for i = 1, n do
    local b = a + 2 + STRIDE * (i - 1)
    local actual = tonumber(ARGV[b + 4])
    local rec = redis.call('GET', KEYS[k + i] .. ':r:' .. rid)
    if not rec then return parts, 2 end
    local amt, late, back, exp, rem, reset, kept =
      string.match(rec, '^=(%d+) (%d+) (%d+) ([01]) (%d+) (%d+) (%d+)$')
    if amt then
      if now >= tonumber(kept) then return parts, 2 end
      settled = settled + 1
      if tonumber(amt) ~= actual then conflict = true end
      parts[i] = { 1, tonumber(late), tonumber(back), tonumber(exp), tonumber(rem), tonumber(reset), tonumber(amt),
        tonumber(kept) }
      ARGV[b + 4], ARGV[b + 5] = 0, 0
    else
      local est, at, til
      est, at, til, kept = string.match(rec, '^(%d+) (%d+) (%d+) (%d+)$')
      if not est or now >= tonumber(kept) then return parts, 2 end
      est, at, til = tonumber(est), tonumber(at), tonumber(til)
      local expired = 0
      if now >= til then expired = 1 end
      late, back = 0, 0
      if actual > est then
        late = actual - est
        ARGV[b + 4], ARGV[b + 5] = late, 4
      elseif actual < est and expired == 0 then
        back = est - actual
        ARGV[b + 4], ARGV[b + 5] = back, math.max(at, 4294967296)
      else
        ARGV[b + 4], ARGV[b + 5] = 0, 0
      end
      parts[i] = { 0, late, back, expired, 0, 0, actual, tonumber(kept) }
    end
  end
  if conflict or (settled > 0 and settled < n) then return parts, 3 end
  return parts, nil
end

-- An allowed reserve (checks from ARGV[a], keys after k, answers after
-- out[head]): each check that allowed keeps its part; the description
-- goes to the request's extra key.
local function reserve_keep(a, k, n, mode, head, now)
  local ttls, mask = {}, {}
  for t in string.gmatch(mode[3], '%d+') do ttls[#ttls + 1] = tonumber(t) end
  local keep = ttls[1] or 600000000
  local px = int(math.floor(keep / 1000) + TTL_SLACK_MS)
  for i = 1, n do
    mask[i] = '0'
    -- (A concurrency limit's slot is released, never settled: no part.)
    if out[head + 1 + 5 * (i - 1)] == 1 and ARGV[a + 2 + STRIDE * (i - 1)] ~= 'cc' then
      local ttl = ttls[i + 1] or 300000000
      local hits = tonumber(ARGV[a + 2 + STRIDE * (i - 1) + 4])
      redis.call('SET', KEYS[k + i] .. ':r:' .. mode[2],
        int(hits) .. ' ' .. int(now) .. ' ' .. int(now + ttl) .. ' ' .. int(now + keep), 'PX', px)
      mask[i] = '1'
    end
  end
  if mode[4] ~= '' then
    redis.call('SET', KEYS[k + n + 1], table.concat(mask) .. '\n' .. mode[4], 'PX', px)
  end
end

-- A settle decided (its answers after out[head]): each part recorded as
-- settled, and the answers rewritten as a settle's.
local function settle_record(k, rid, parts, head, now)
  for i, p in ipairs(parts) do
    local at = head + 1 + 5 * (i - 1)
    if p[1] == 0 then
      p[5], p[6] = out[at + 1], out[at + 2]
      -- A settled record answers the same settle again for a minute (or
      -- until it would have gone anyway).
      local kept = math.min(p[8], now + SETTLED_KEPT_US)
      redis.call('SET', KEYS[k + i] .. ':r:' .. rid, '=' .. int(p[7]) .. ' ' .. int(p[2]) .. ' ' .. int(p[3]) .. ' '
        .. p[4] .. ' ' .. int(p[5]) .. ' ' .. int(p[6]) .. ' ' .. int(kept),
        'PX', int(math.floor((kept - now) / 1000) + TTL_SLACK_MS))
    end
    out[at], out[at + 1], out[at + 2], out[at + 3], out[at + 4] = p[1] + 2 * p[4], p[2], p[3], p[5], p[6]
  end
  out[head] = 0
end

local allowed_at = {}
-- A concurrency check's slots expired and held before it (cc_account).
local cc_expired, cc_before = {}, {}
a, k = 2, 0
while a <= #ARGV do
  local now
  local t, mode = header(ARGV[a])
  if t == '' then
    now = time_now()
    TTL_SLACK_MS = 2
  else
    now = tonumber(t)
    TTL_SLACK_MS = 3600000
  end
  local n = tonumber(ARGV[a + 1])
  o = o + 1
  out[o] = now
  local parts, refused = nil, nil
  if mode and mode[1] == 's' then parts, refused = settle_prepare(a, k, n, mode[2], now) end
  if refused then
    -- A settle of an unknown reservation, or at other amounts: nothing done.
    o = o + 1
    out[o] = refused
    for i = 1, n do
      local amount = 0
      if refused == 3 and parts[i] then amount = parts[i][7] end
      out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = amount, 0, 0, 0, 0
      o = o + 5
    end
  elseif refunding then
    for i = 1, n do
      local alg, l, w, p, hits, at = check(a, i)
      local spec, _, code, _, lop = scope(a, i)
      refund(KEYS[k + i], alg, l, w, p, hits, at, now, spec, code, lop)
    end
  else
    local head = o + 1
    out[head] = 0
    o = head
    local denied = false
    for i = 1, n do
      local alg, l, w, p, hits, flag = check(a, i)
      local spec, fp, code, x, lop = scope(a, i)
      local allowed, remaining, reset, retry, delay
      -- A flag of 2^32 or more is a return: give back the hits taken at
      -- that time (us) as if never taken (Limit::refund), then answer as a
      -- refund does.
      local taken_at = nil
      local cc = code == 'cc' and l > 0
      if cc then
        cc_expired[i] = cc_prune(KEYS[k + i], now)
        cc_before[i] = cc_used(KEYS[k + i])
      end
      if flag >= 4294967296 then taken_at, flag = flag, 2 end
      local after = flag >= 4
      if after then flag = flag - 4 end
      if flag == 2 then
        -- A refund (Limit::give_back), answered as a peek afterwards. A
        -- global check gives back this region's own count, and records it
        -- for the peers (ggive_back).
        if l > 0 and hits > 0 then
          if spec then
            ggive_back(KEYS[k + i], code, alg, l, w, p, hits, now, spec, taken_at)
          elseif taken_at then
            alg.refund(KEYS[k + i], l, w, p, hits, taken_at, math.max(now, taken_at))
          else
            alg.give_back(KEYS[k + i], l, w, p, hits, now)
          end
        end
        hits = 0
      end
      if l == 0 then
        -- No limit: a late charge is taken (nowhere to count it), the
        -- gate and every other hit denied.
        allowed, remaining, reset, retry, delay = (hits == 0 and not after) or (after and hits > 0), 0, 0, -1, 0
      elseif lop then
        allowed, remaining, reset, retry, delay = leased(KEYS[k + i], l, w, hits, lop, now)
      elseif spec and not (x == '=' and quiet[KEYS[k + i]] == true) then
        -- Global: decide over every region's counts, then count and cap.
        -- (A quiet check whose state is marked, the common case, is
        -- decided below as a regional one: no peer counts for it and it
        -- has no cap. A window algorithm's key with no G:x skips the calls
        -- here: in Redis's Lua they cost what a regional decision's own
        -- work does.)
        local key = KEYS[k + i]
        -- A quiet check's G:x, named when its state was read unmarked.
        if x == '=' then x = quiet[key] end
        local gcra = code == 'gc' or code == 'sh'
        if gcra or raw[x] then
          REMOTE = gmeta(x, key, code, l, w, p, fp, spec[1], spec[2], now)
        end
        if spec[7] > 0 and not gcra then
          -- Dead incarnations' possible hits count in the current slot.
          local t = {}
          if REMOTE then for s, v in pairs(REMOTE) do t[s] = v end end
          local cur = divmod(now, spec[1])
          t[cur] = (t[cur] or 0) + spec[7]
          REMOTE = t
        end
        if gcra and spec[9] ~= '' then gdebts(key, l, w, spec[9]) end
        -- The GCRA state as it was: a capped request leaves it exactly so
        -- (a refund would leave a tat clamped up to now).
        local before = nil
        if gcra then
          local s = numbers(key, 2)
          if s then before = { s[1], s[2] } else before = { 0, 0 } end
        end
        if after then
          allowed, remaining, reset, retry, delay = charged(alg, key, l, w, p, hits, now, true)
        else
          allowed, remaining, reset, retry, delay = alg.apply(key, l, w, p, hits, now)
        end
        REMOTE = nil
        if allowed and hits > 0 and (gcra or spec[3] > 0 or spec[5] > 0 or spec[8] == 1) then
          local left, capped_retry = gcommit(key, code, l, w, p, hits, now, spec, alg, before, after)
          if left then
            allowed, retry, delay = false, capped_retry, 0
            remaining = math.min(left, remaining + hits)
          end
        end
      elseif after then
        allowed, remaining, reset, retry, delay = charged(alg, KEYS[k + i], l, w, p, hits, now, true)
      else
        allowed, remaining, reset, retry, delay = alg.apply(KEYS[k + i], l, w, p, hits, now)
      end
      -- A refund took nothing: nothing to undo.
      allowed_at[i] = allowed and flag ~= 2 and not (after and hits > 0)
      if not allowed and flag == 1 then denied = true end
      if allowed then out[o + 1] = 1 else out[o + 1] = 0 end
      if cc then delay = cc_account(cc_expired[i], cc_before[i], cc_used(KEYS[k + i])) end
      out[o + 2], out[o + 3], out[o + 4], out[o + 5] = remaining, reset, retry, delay
      o = o + 5
    end
    if denied then
      out[head] = 1
      for i = n, 1, -1 do
        if allowed_at[i] then
          local alg, l, w, p, hits = check(a, i)
          local spec, _, code, _, lop = scope(a, i)
          refund(KEYS[k + i], alg, l, w, p, hits, now, now, spec, code, lop)
          if code == 'cc' and l > 0 then
            out[head + 5 * i] = cc_account(cc_expired[i], cc_before[i], cc_used(KEYS[k + i]))
          end
        end
      end
    end
    if mode and mode[1] == 'r' and not denied then reserve_keep(a, k, n, mode, head, now) end
    if parts then settle_record(k, mode[2], parts, head, now) end
  end
  a, k = a + 2 + STRIDE * n, k + n + extra(mode)
end
flush()
return out
