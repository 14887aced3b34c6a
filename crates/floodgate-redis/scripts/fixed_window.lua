-- fixed_window.lua: count per epoch-aligned window.
-- State: the string "<window id> <count>", expiring at the window's end.
-- apply(key, limit, window, _, hits, now) -> allowed, remaining, reset, retry, delay
--   allow iff count + hits <= limit (hits = 0: a peek, always allowed).
-- refund(key, limit, window, _, hits, at, now): give back hits admitted at
--   `at`, if its window is still the current one.
-- give_back(key, limit, window, _, hits, now): a refund that names no
--   request (Limit::give_back): from the current window's count.

ALG.fw = { string = true }

function ALG.fw.apply(key, l, w, _, hits, now)
  local s = numbers(key, 2)
  local id, count = 0, 0
  if s then id, count = s[1], s[2] end
  local wid, e = divmod(now, w)
  if wid < id then wid = id; e = 0 end
  local moved = false
  if wid ~= id then id = wid; count = 0; moved = s ~= nil end
  local until_end = w - e
  -- Every region's count (global), or this one's.
  local seen = count + remote(id)
  if hits == 0 or hits <= l - seen then
    count = count + hits
    seen = seen + hits
    if hits > 0 or moved then put(key, until_end, id, count) end
    local reset = 0
    if seen > 0 then reset = until_end end
    return true, math.max(l - seen, 0), reset, -1, 0
  end
  local reset, retry = 0, -1
  if seen > 0 then reset = until_end end
  if hits <= l then retry = until_end end
  -- The window moved on: keep that (it is the same state), so a clock
  -- that steps back later sees what the memory store sees.
  if moved then put(key, until_end, id, 0) end
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
  put(key, (id - wid) * w + w - e, id, count)
end
