-- fixed_window.lua: count per epoch-aligned window.
-- State: the string "<window id> <count>", expiring at the window's end.
-- apply(key, limit, window, _, hits, now) -> allowed, remaining, reset, retry, delay
--   allow iff count + hits <= limit (hits = 0: a peek, always allowed).
-- refund(key, limit, window, _, hits, at, now): give back hits admitted at
--   `at`, if its window is still the current one.
-- give_back(key, limit, window, _, hits, now): a refund that names no
--   request (Limit::give_back): from the current window's count.

ALG.fw = { string = true }

-- How long count `c` keeps the key from `until_end` (the rest of its
-- window): that window, then one more per limit's worth beyond it (debt,
-- a limit's worth paid off per window), at most 2^53 - 1 us.
local function fw_lasts(until_end, c, l, w)
  if c <= l then return until_end end
  return math.min(until_end + divmod(c - 1, l) * w, MAXN)
end

-- Until count `c` is paid off (none: 0). (A function of its own, not a
-- closure in apply: making one per decision costs more than its body.)
local function fw_reset(until_end, c, l, w)
  if c <= 0 then return 0 end
  return fw_lasts(until_end, c, l, w)
end

function ALG.fw.apply(key, l, w, _, hits, now)
  local s = numbers(key, 2)
  local id, count = 0, 0
  if s then id, count = s[1], s[2] end
  local wid, e = divmod(now, w)
  if wid < id then wid = id; e = 0 end
  local moved = false
  if wid ~= id then
    -- Debt (late charges) carries: a limit's worth paid off per window.
    count = math.max(count - l * (wid - id), 0)
    id = wid
    moved = s ~= nil
  end
  local until_end = w - e
  -- Every region's count (global), or this one's.
  local seen = count + remote(id)
  if hits == 0 or hits <= l - seen or FORCE then
    local add = math.min(hits, MAXN - count)
    count = count + add
    seen = seen + add
    if add > 0 or moved then put(key, fw_lasts(until_end, count, l, w), id, count) end
    return true, math.max(l - seen, 0), fw_reset(until_end, seen, l, w), -1, 0
  end
  local reset, retry = fw_reset(until_end, seen, l, w), -1
  if hits <= l then
    -- The least number of windows k with seen - k * limit + hits <= limit:
    -- ceil((seen + hits - limit) / limit).
    local k = divmod(seen + hits - 1, l)
    retry = math.min(until_end + (k - 1) * w, MAXN)
  end
  -- The window moved on: keep that (it is the same state), so a clock
  -- that steps back later sees what the memory store sees.
  if moved then put(key, fw_lasts(until_end, count, l, w), id, count) end
  return false, math.max(l - seen, 0), reset, retry, 0
end

function ALG.fw.give_back(key, l, w, p, hits, now)
  ALG.fw.apply(key, l, w, p, 0, now)
  local s = numbers(key, 2)
  -- The state's window is the current one (a clock behind it reads so).
  if s then ALG.fw.refund(key, l, w, p, hits, math.max(now, s[1] * w), now) end
end

function ALG.fw.refund(key, l, w, _, hits, at, now)
  local s = numbers(key, 2)
  if not s then return end
  local id, count = s[1], s[2]
  if divmod(at, w) ~= id then return end
  count = count - math.min(hits, count)
  local wid, e = divmod(math.max(now, at), w)
  -- Debt still to pay off keeps the key for the windows it takes.
  put(key, fw_lasts((id - wid) * w + w - e, count, l, w), id, count)
end
