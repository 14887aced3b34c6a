-- gcra.lua: gcra, token_bucket and leaky_bucket (meter: `gc`; shaper: `sh`).
-- State: the string "<tat microseconds> <remainder>": the theoretical
-- arrival time tat = us + rem / limit microseconds (rem < limit), kept
-- exactly (the emission interval window / limit is never rounded), expiring
-- when tat passes.
-- Times below are pairs (whole microseconds, remainder in 1/limit us).
-- apply(key, limit, window, burst, hits, now) -> allowed, remaining, reset, retry, delay
--   meter: allow iff limit * (max(tat, now) - now) + hits * window <= burst * window;
--   shaper: capacity burst + 1 and delay = max(0, tat - now).
--   Then tat = max(tat, now) + hits * window / limit.
-- refund(key, limit, window, burst, hits, at, now): move tat back by what
--   the hits cost, less the time elapsed since `at`.

ALG.gc = { string = true }
ALG.sh = { string = true }

-- (a + b), pairs with remainders below l.
local function tadd(au, ar, bu, br, l)
  if ar >= l - br then return au + bu + 1, ar - (l - br) end
  return au + bu, ar + br
end

-- (a - b) for a >= b.
local function tsub(au, ar, bu, br, l)
  if ar >= br then return au - bu, ar - br end
  return au - bu - 1, ar + (l - br)
end

-- a <= b
local function tle(au, ar, bu, br)
  return au < bu or (au == bu and ar <= br)
end

local function gcra_load(key)
  local s = numbers(key, 2)
  if s then return s[1], s[2] end
  return 0, 0
end

-- What a backlog (xu, xr) leaves of a capacity (cu, cr): whole hits. (A
-- function of its own, not a closure in gcra_apply: making one per
-- decision costs more than its body.)
local function gcra_remaining(xu, xr, cu, cr, l, w)
  if not tle(xu, xr, cu, cr) then return 0 end
  local du, dr = tsub(cu, cr, xu, xr, l)
  return (muldivmod(du, l, dr, w))
end

local function gcra_apply(key, l, w, burst, hits, now, shape)
  local slots = burst
  if shape then slots = burst + 1 end
  local us, rem = gcra_load(key)
  -- The backlog: how far tat is ahead of now.
  local bu, br = 0, 0
  if us >= now then bu, br = us - now, rem end
  -- The capacity, slots * window / limit.
  local cu, cr = muldivmod(slots, w, 0, l)
  local reset = 0
  if us >= now then
    reset = us - now
    if rem > 0 then reset = reset + 1 end
  end
  if hits == 0 then
    return true, gcra_remaining(bu, br, cu, cr, l, w), reset, -1, 0
  end
  if hits > slots and not FORCE then
    return false, gcra_remaining(bu, br, cu, cr, l, w), reset, -1, 0
  end
  if FORCE and hits > muldivmod(MAXN - math.max(us, now), l, 0, w) then
    -- A late charge past 2^53 - 1 us: the TAT saturates there.
    put(key, MAXN - now, MAXN, 0)
    return true, 0, MAXN - now, -1, 0
  end
  local ku, kr = muldivmod(hits, w, 0, l)
  local nu, nr = tadd(bu, br, ku, kr, l)
  if not tle(nu, nr, cu, cr) and not FORCE then
    local eu, er = tsub(nu, nr, cu, cr, l)
    if er > 0 then eu = eu + 1 end
    return false, gcra_remaining(bu, br, cu, cr, l, w), reset, eu, 0
  end
  local delay = 0
  if shape and not FORCE then delay = reset end
  if bu == 0 and br == 0 then us, rem = now, 0 end
  us, rem = tadd(us, rem, ku, kr, l)
  local new_reset = us - now
  if rem > 0 then new_reset = new_reset + 1 end
  put(key, new_reset, us, rem)
  return true, gcra_remaining(nu, nr, cu, cr, l, w), new_reset, -1, delay
end

function ALG.gc.apply(key, l, w, burst, hits, now)
  return gcra_apply(key, l, w, burst, hits, now, false)
end

function ALG.sh.apply(key, l, w, burst, hits, now)
  return gcra_apply(key, l, w, burst, hits, now, true)
end

function ALG.gc.refund(key, l, w, _, hits, at, now)
  local s = numbers(key, 2)
  if not s then return end
  local us, rem = s[1], s[2]
  -- What the hits cost, less the time since they were taken (as a pair).
  local ku, kr = muldivmod(hits, w, 0, l)
  local elapsed = math.max(now - at, 0)
  if not tle(ku, kr, elapsed, 0) then
    local bu, br = tsub(ku, kr, elapsed, 0, l)
    if tle(bu, br, us, rem) then
      us, rem = tsub(us, rem, bu, br, l)
    else
      us, rem = 0, 0
    end
  end
  local ttl = us - math.max(now, at)
  if rem > 0 then ttl = ttl + 1 end
  put(key, ttl, us, rem)
end

ALG.sh.refund = ALG.gc.refund

-- give_back(key, limit, window, burst, hits, now): a refund that names no
-- request (Limit::give_back): the TAT moves back by hits intervals, never
-- past full.
function ALG.gc.give_back(key, l, w, p, hits, now)
  ALG.gc.refund(key, l, w, p, hits, now, now)
end

ALG.sh.give_back = ALG.gc.give_back
