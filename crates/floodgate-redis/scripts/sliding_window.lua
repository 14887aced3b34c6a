-- sliding_window.lua: Cloudflare's two-counter estimate.
-- State: the string "<window id> <previous count> <current count>", expiring
-- when neither count matters any more (the end of the next window).
-- apply(key, limit, window, _, hits, now) -> allowed, remaining, reset, retry, delay
--   with e = now - window start: allow iff
--   prev * (window - e) + (cur + hits) * window <= limit * window, computed as
--   cur + hits + ceil(prev * (window - e) / window) <= limit (the same test:
--   limit - cur - hits is a whole number).
-- refund(key, limit, window, _, hits, at, now): give back hits admitted at
--   `at` from the current count, or the previous one if the window moved on.

ALG.sw = { string = true }

local function sw_load(key, w, now)
  local s = numbers(key, 3)
  local id, prev, cur = 0, 0, 0
  if s then id, prev, cur = s[1], s[2], s[3] end
  local wid, e = divmod(now, w)
  if wid < id then wid = id; e = 0 end
  local moved = false
  if wid ~= id then
    if wid == id + 1 then prev = cur else prev = 0 end
    cur = 0
    id = wid
    moved = s ~= nil
  end
  return id, prev, cur, e, moved
end

local function sw_reset(w, e, prev, cur)
  if cur > 0 then return 2 * w - e end
  if prev > 0 then return w - e end
  return 0
end

function ALG.sw.apply(key, l, w, _, hits, now)
  local own_id, own_prev, own_cur, e, moved = sw_load(key, w, now)
  -- Every region's counts (global), or this one's.
  local id = own_id
  local prev, cur = own_prev + remote(id - 1), own_cur + remote(id)
  -- The previous window's weight, rounded up to whole units.
  local pq, pr = muldivmod(prev, w - e, 0, w)
  if pr > 0 then pq = pq + 1 end
  local free = l - cur - pq
  if hits == 0 or hits <= free or FORCE then
    hits = math.min(hits, MAXN - own_cur)
    cur = cur + hits
    own_cur = own_cur + hits
    local reset = sw_reset(w, e, prev, cur)
    if hits > 0 or moved then put(key, sw_reset(w, e, own_prev, own_cur), id, own_prev, own_cur) end
    return true, math.max(free - hits, 0), reset, -1, 0
  end
  local retry = -1
  if hits <= l then
    if hits <= l - cur then
      -- Later in this window, once enough of prev has slid out (prev > 0,
      -- or this would have been allowed): the largest m with
      -- prev * m <= (limit - cur - hits) * window is below window - e.
      local m = muldivmod(l - cur - hits, w, 0, prev)
      retry = (w - e) - math.min(m, w - e)
    else
      -- Next window: prev' = cur > 0, cur' = 0; allowed from e' with
      -- cur * (window - e') <= (limit - hits) * window.
      local e_next = 0
      if l - hits < cur then
        e_next = w - muldivmod(l - hits, w, 0, cur)
      end
      retry = (w - e) + e_next
    end
  end
  local reset = sw_reset(w, e, prev, cur)
  -- The window moved on: keep that (the same state; see fixed_window.lua).
  if moved then put(key, sw_reset(w, e, own_prev, own_cur), id, own_prev, own_cur) end
  return false, math.max(free, 0), reset, retry, 0
end

-- give_back(key, limit, window, _, hits, now): a refund that names no
-- request (Limit::give_back): the current count first, then the previous.
function ALG.sw.give_back(key, l, w, p, hits, now)
  ALG.sw.apply(key, l, w, p, 0, now)
  local s = numbers(key, 3)
  if not s then return end
  local id, prev, cur = s[1], s[2], s[3]
  local from_cur = math.min(hits, cur)
  cur = cur - from_cur
  prev = prev - math.min(hits - from_cur, prev)
  local wid, e = divmod(now, w)
  if wid < id then e = 0 end
  put(key, sw_reset(w, e, prev, cur), id, prev, cur)
end

function ALG.sw.refund(key, l, w, _, hits, at, now)
  local s = numbers(key, 3)
  if not s then return end
  local id, prev, cur = s[1], s[2], s[3]
  local wid = divmod(at, w)
  if wid == id then
    cur = cur - math.min(hits, cur)
  elseif wid + 1 == id then
    prev = prev - math.min(hits, prev)
  else
    return
  end
  local nid, e = divmod(math.max(now, at), w)
  local ttl = sw_reset(w, e, prev, cur) + (id - nid) * w
  put(key, ttl, id, prev, cur)
end
