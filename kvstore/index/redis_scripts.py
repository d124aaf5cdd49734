"""The Redis prefix index's Lua scripts that run on one namespace's slot (lookup, holders,
write, refresh, retire, purge), :class:`_Script` (a script and its SHA-1), and the chain of
keys as those scripts read it (:func:`_chain`).

The key layout the scripts read and write is :mod:`kvstore.index.redis`'s docstring.
"""

from __future__ import annotations

import hashlib
import sys
import zlib
from array import array

LOAD = 40  # blocks per bucket on average; buckets stay under listpack's 128 entries
MAX_BUCKETS = 26**5  # bucket names have five letters; past ~475M blocks a namespace's buckets grow instead

# ---- Lua ------------------------------------------------------------------------

_COMMON = r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ecmp(a, b)  -- epochs are decimal strings up to 2^63: compare without floats
  if #a ~= #b then if #a < #b then return -1 else return 1 end end
  if a == b then return 0 end
  if a < b then return -1 else return 1 end
end
"""

_NS = _COMMON + r"""
local sbyte, ssub, schar, floor = string.byte, string.sub, string.char, math.floor
local META = KEYS[1]
local BASE = ssub(META, 1, -5)
local MK, IK, DEAD, BK = BASE .. 'm', BASE .. 'i', BASE .. 'dead', BASE .. 'b:'
local LOAD, MAX_BUCKETS = @LOAD@, @MAX_BUCKETS@
local M, S, NOW = 1, 0, 0

local function load_meta()
  local v = redis.call('HMGET', META, 'M', 'S')
  M = tonumber(v[1]) or 1
  S = tonumber(v[2]) or 0
end
local function addr(h)
  local a = h % M
  if a < S then a = h % (2 * M) end
  return a
end
-- Bucket a's key: a in five base-26 digits 'a'..'z', least significant first. Letters, not
-- decimal: Lua formats a number into a string with sprintf, several times slower than this.
local function bucket(a)
  return BK .. schar(97 + a % 26, 97 + floor(a / 26) % 26, 97 + floor(a / 676) % 26,
    97 + floor(a / 17576) % 26, 97 + floor(a / 456976))
end

-- A block's field is its key then the key's CRC-32 (u32 little-endian), so a split needs
-- no hashing. A chain travels as two strings: key lengths (u16 little-endian; just one
-- when every key has that length, the common case) and the fields end to end.
local function widths(ls, fs)  -- the chain's length, and its fields' width if they share one
  if #ls == 2 then
    local l1, l2 = sbyte(ls, 1, 2)
    local w = l1 + 256 * l2 + 4
    return #fs / w, w
  end
  return #ls / 2, nil
end
local function hash_at(f, e)  -- the CRC-32 in the 4 bytes that end at e
  local a, b, c, d = sbyte(f, e - 3, e)
  return ((d * 256 + c) * 256 + b) * 256 + a
end
local function chain(i)  -- yields field, hash, index
  local ls, fs = ARGV[i], ARGV[i + 1]
  local n, w = widths(ls, fs)
  local j, pos = 0, 1
  return function()
    j = j + 1
    if j > n then return nil end
    local e
    if w then
      e = pos + w - 1
    else
      local l1, l2 = sbyte(ls, 2 * j - 1, 2 * j)
      e = pos + l1 + 256 * l2 + 3
    end
    local f = ssub(fs, pos, e)
    pos = e + 1
    return f, hash_at(fs, e), j
  end
end

-- A block's value: one 4-byte record per holder, big-endian holder id * 8 + tier, sorted
-- by holder id. Sorted, two blocks with the same holders in the same tiers have equal
-- values, which a lookup compares without decoding them.
local function rec(lid, tier)
  local x = lid * 8 + tier
  return string.char(floor(x / 16777216), floor(x / 65536) % 256, floor(x / 256) % 256, x % 256)
end
local function rec_at(v, p)
  local a, b, c, d = sbyte(v, p, p + 3)
  local x = ((a * 256 + b) * 256 + c) * 256 + d
  return floor(x / 8), x % 8
end
local function place(v, lid)  -- where holder lid's record is (true) or goes (false)
  for p = 1, #v, 4 do
    local l = rec_at(v, p)
    if l >= lid then return p, l == lid end
  end
  return #v + 1, false
end
local function find(v, lid)
  local p, here = place(v, lid)
  if here then return p end
  return nil
end

-- reverse index: how many rows holder lid has in bucket a
local function rev(lid, a, delta)
  local chunk = floor(a / 128)
  local rk = BASE .. 'r:' .. lid .. ':' .. chunk
  local n = redis.call('HINCRBY', rk, a % 128, delta)
  if n <= 0 then
    redis.call('HDEL', rk, a % 128)
    if redis.call('EXISTS', rk) == 0 then redis.call('SREM', BASE .. 'rc:' .. lid, chunk) end
  elseif n == delta then
    redis.call('SADD', BASE .. 'rc:' .. lid, chunk)
  end
end

local function member(node)
  local cur = redis.call('HGET', MK, node)
  if not cur then return 0, 0 end
  local l, g = string.match(cur, '^(%d+) (%d+)$')
  return tonumber(l), tonumber(g)
end
local function retire(lid)
  redis.call('SADD', DEAD, lid)
  redis.call('HDEL', IK, lid)
end

local live_cache = {}
local function live(lid)  -- {node, epoch} if holder lid is current and alive, else false
  local c = live_cache[lid]
  if c == nil then
    c = false
    local r = redis.call('HGET', IK, lid)
    if r then
      local e, g, d, node = string.match(r, '^(%d+) (%d+) (%d+) (.*)$')
      if tonumber(d) > NOW then c = {node, e} end
    end
    live_cache[lid] = c
  end
  return c
end
""".replace("@LOAD@", str(LOAD)).replace("@MAX_BUCKETS@", str(MAX_BUCKETS))

# ARGV: number of candidates (-1: any node), the candidates, the chain (2 strings).
# Returns node, blocks, tier, ... for every live node holding the chain's first block.
#
# The walk keeps the holders of every block so far (holder id -> slowest tier); each
# holds exactly ``depth`` leading blocks, so a block with the previous block's value
# (same holders, same tiers: the common case along a shared prefix) only moves depth
# on. A value that differs is decoded against that set alone, and the first block's
# holders are checked for liveness in one HMGET, not one call a holder.
_LOOKUP = _NS + r"""
local call = redis.call
NOW = now_ms()
load_meta()
local nc = tonumber(ARGV[1])
local cand, first = nil, 2
if nc >= 0 then
  cand = {}
  for j = 2, nc + 1 do cand[ARGV[j]] = true end
  first = nc + 2
end
local ls, fs = ARGV[first], ARGV[first + 1]
local n, w = widths(ls, fs)
local M2, pos = 2 * M, 1
local held, name, out = nil, {}, {}
local prev, depth = nil, 0
for j = 1, n do
  local e
  if w then
    e = pos + w - 1
  else
    local l1, l2 = sbyte(ls, 2 * j - 1, 2 * j)
    e = pos + l1 + 256 * l2 + 3
  end
  local b1, b2, b3, b4 = sbyte(fs, e - 3, e)
  local h = ((b4 * 256 + b3) * 256 + b2) * 256 + b1
  local a = h % M
  if a < S then a = h % M2 end
  -- bucket(a) and the field, inline: this loop is the lookup's cost
  local v = call('HGET', BK .. schar(97 + a % 26, 97 + floor(a / 26) % 26, 97 + floor(a / 676) % 26,
    97 + floor(a / 17576) % 26, 97 + floor(a / 456976)), ssub(fs, pos, e))
  pos = e + 1
  if not v then break end
  if v ~= prev then
    prev = v
    local nxt, any = {}, false
    if held == nil then
      local ids, ts = {}, {}
      for p = 1, #v, 4 do
        ids[#ids + 1], ts[#ts + 1] = rec_at(v, p)
      end
      for q0 = 1, #ids, 1000 do  -- unpack stays far below Lua's C stack limit
        local q1 = math.min(q0 + 999, #ids)
        local rows = call('HMGET', IK, unpack(ids, q0, q1))
        for q = q0, q1 do
          local r = rows[q - q0 + 1]
          if r then
            local d, node = string.match(r, '^%d+ %d+ (%d+) (.*)$')
            if tonumber(d) > NOW and (cand == nil or cand[node]) then
              nxt[ids[q]] = ts[q]
              name[ids[q]] = node
              any = true
            end
          end
        end
      end
    else
      for p = 1, #v, 4 do
        local r1, r2, r3, r4 = sbyte(v, p, p + 3)
        local t0 = held[((r1 * 256 + r2) * 256 + r3) * 32 + floor(r4 / 8)]
        if t0 then
          local t = r4 % 8
          if t < t0 then t = t0 end
          nxt[((r1 * 256 + r2) * 256 + r3) * 32 + floor(r4 / 8)] = t
          any = true
        end
      end
      for lid, t in pairs(held) do  -- holders of every block so far that lack this one
        if not nxt[lid] then
          out[#out + 1] = name[lid]
          out[#out + 1] = depth
          out[#out + 1] = t
        end
      end
    end
    held = nxt
    if not any then break end  -- no node that holds every block so far holds this one
  end
  depth = j
end
for lid, t in pairs(held or {}) do
  out[#out + 1] = name[lid]
  out[#out + 1] = depth
  out[#out + 1] = t
end
return out
"""

# ARGV: the chain (2 strings). Returns per key {node, tier, epoch, ...}.
_HOLDERS = _NS + r"""
NOW = now_ms()
load_meta()
local out, seen = {}, {}
for f, h, j in chain(1) do
  local v = redis.call('HGET', bucket(addr(h)), f)
  local hs = {}
  if v then
    hs = seen[v]  -- equal values, equal answers (a shared prefix is decoded once)
    if not hs then
      hs = {}
      for p = 1, #v, 4 do
        local lid, t = rec_at(v, p)
        local who = live(lid)
        if who then
          hs[#hs + 1] = who[1]
          hs[#hs + 1] = t
          hs[#hs + 1] = who[2]
        end
      end
      seen[v] = hs
    end
  end
  out[j] = hs
end
return out
"""

# ARGV: op ('add' | 'del'), node, epoch, incarnation to bind ('' = trust the mirror), its ms
# left, the chain (2 strings), and for 'add' one tier byte per key.
_WRITE = _NS + r"""
local function hset_all(key, fv)
  for j = 1, #fv, 200 do redis.call('HSET', key, unpack(fv, j, math.min(j + 199, #fv))) end
end
local function split()  -- linear hashing: bucket S splits into S and S + M
  local a0, a1 = S, S + M
  local k0 = bucket(a0)
  local all = redis.call('HGETALL', k0)
  local keep, move, moved = {}, {}, {}
  for j = 1, #all, 2 do
    local f, v = all[j], all[j + 1]
    if hash_at(f, #f) % (2 * M) == a1 then
      move[#move + 1] = f
      move[#move + 1] = v
      for p = 1, #v, 4 do
        local lid = rec_at(v, p)
        moved[lid] = (moved[lid] or 0) + 1
      end
    else
      keep[#keep + 1] = f
      keep[#keep + 1] = v
    end
  end
  if #move > 0 then
    redis.call('DEL', k0)  -- rewritten whole, so a bucket that outgrew listpack gets compact again
    hset_all(k0, keep)
    hset_all(bucket(a1), move)
    for lid, n in pairs(moved) do
      rev(lid, a0, -n)
      rev(lid, a1, n)
    end
  end
  S = S + 1
  if S == M then
    M = 2 * M
    S = 0
  end
end

NOW = now_ms()
load_meta()
local op, node, epoch, bind = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local clid, cg = member(node)
local lid
if bind == '' then
  if clid == 0 then return {'NOJOIN'} end
  local r = redis.call('HGET', IK, clid)
  if not r then return {'NOJOIN'} end
  local e, g, d = string.match(r, '^(%d+) (%d+) (%d+) ')
  local c = ecmp(epoch, e)
  if c < 0 then return {'STALE', e} end
  if c > 0 or tonumber(d) <= NOW then return {'NOJOIN'} end
  lid = clid
else
  local g = tonumber(bind)
  if cg > g then return {'NEWER'} end
  if cg == g and clid == 0 then return {'GONE'} end
  local deadline = NOW + tonumber(ARGV[5])
  local r = nil
  if cg == g then r = redis.call('HGET', IK, clid) end
  if r then
    lid = clid
    local d = tonumber(string.match(r, '^%d+ %d+ (%d+) '))
    if d > deadline then deadline = d end
  else
    if clid > 0 then retire(clid) end
    lid = redis.call('HINCRBY', META, 'seq', 1)
    if lid >= 536870912 then return redis.error_reply('holder ids of this namespace are exhausted') end
  end
  redis.call('HSET', MK, node, lid .. ' ' .. bind)
  redis.call('HSET', IK, lid, epoch .. ' ' .. bind .. ' ' .. deadline .. ' ' .. node)
end

local fields = 0
if op == 'add' then
  local tiers = ARGV[8]
  for f, h, j in chain(6) do
    local a = addr(h)
    local bk = bucket(a)
    local r = rec(lid, sbyte(tiers, j))
    local v = redis.call('HGET', bk, f)
    if not v then
      redis.call('HSET', bk, f, r)
      rev(lid, a, 1)
      fields = fields + 1
    else
      local p, here = place(v, lid)
      if not here then
        redis.call('HSET', bk, f, ssub(v, 1, p - 1) .. r .. ssub(v, p))
        rev(lid, a, 1)
      elseif ssub(v, p, p + 3) ~= r then
        redis.call('HSET', bk, f, ssub(v, 1, p - 1) .. r .. ssub(v, p + 4))
      end
    end
  end
  if fields > 0 then
    local total = redis.call('HINCRBY', META, 'N', fields)
    local budget = floor(fields / LOAD) + 2
    local m0, s0 = M, S
    while total > LOAD * (M + S) and budget > 0 and M + S < MAX_BUCKETS do
      split()
      budget = budget - 1
    end
    if M ~= m0 or S ~= s0 then redis.call('HSET', META, 'M', M, 'S', S) end
  end
else
  for f, h in chain(6) do
    local a = addr(h)
    local bk = bucket(a)
    local v = redis.call('HGET', bk, f)
    local p = v and find(v, lid)
    if p then
      if #v == 4 then
        redis.call('HDEL', bk, f)
        fields = fields + 1
      else
        redis.call('HSET', bk, f, ssub(v, 1, p - 1) .. ssub(v, p + 4))
      end
      rev(lid, a, -1)
    end
  end
  if fields > 0 then redis.call('HINCRBY', META, 'N', -fields) end
end
return {'OK'}
"""

# ARGV: node, incarnation, ttl ms. Extends the mirror's deadline if it names that incarnation.
_REFRESH = _NS + r"""
NOW = now_ms()
local node = ARGV[1]
local lid, g = member(node)
if lid == 0 or g ~= tonumber(ARGV[2]) then return 0 end
local r = redis.call('HGET', IK, lid)
if not r then return 0 end
local e = string.match(r, '^(%d+) ')
redis.call('HSET', IK, lid, e .. ' ' .. g .. ' ' .. (NOW + tonumber(ARGV[3])) .. ' ' .. node)
return 1
"""

# ARGV: node, ended incarnation ('' = clear whatever is current). Returns the retired holder id or 0.
_RETIRE = _NS + r"""
local node, ended = ARGV[1], ARGV[2]
local lid, g = member(node)
if ended ~= '' then
  if g > tonumber(ended) then return 0 end  -- a newer incarnation writes here already
  redis.call('HSET', MK, node, '0 ' .. ended)  -- tombstone: a late bind of the ended one is refused
elseif lid > 0 then
  redis.call('HDEL', MK, node)
end
if lid > 0 then retire(lid) end
return lid
"""

# ARGV: holder id ('' = every retired one), budget. Returns {rows deleted, 1 if rows remain}.
_PURGE = _NS + r"""
local budget = tonumber(ARGV[2])
local lids
if ARGV[1] ~= '' then lids = {ARGV[1]} else lids = redis.call('SMEMBERS', DEAD) end
local deleted, fields = 0, 0
for _, ls in ipairs(lids) do
  if deleted >= budget then break end
  local lid = tonumber(ls)
  local rc = BASE .. 'rc:' .. lid
  for _, c in ipairs(redis.call('SMEMBERS', rc)) do
    if deleted >= budget then break end
    local rk = BASE .. 'r:' .. lid .. ':' .. c
    local ents = redis.call('HGETALL', rk)
    for j = 1, #ents, 2 do
      if deleted >= budget then break end
      local bk = bucket(tonumber(c) * 128 + tonumber(ents[j]))
      local all = redis.call('HGETALL', bk)
      local n, whole = 0, true
      for q = 1, #all, 2 do
        local v = all[q + 1]
        local p = find(v, lid)
        if p then
          if deleted >= budget then
            whole = false
            break
          end
          if #v == 4 then
            redis.call('HDEL', bk, all[q])
            fields = fields + 1
          else
            redis.call('HSET', bk, all[q], ssub(v, 1, p - 1) .. ssub(v, p + 4))
          end
          deleted = deleted + 1
          n = n + 1
        end
      end
      if whole then redis.call('HDEL', rk, ents[j]) else redis.call('HINCRBY', rk, ents[j], -n) end
    end
    if redis.call('EXISTS', rk) == 0 then redis.call('SREM', rc, c) end
  end
  if redis.call('EXISTS', rc) == 0 then redis.call('SREM', DEAD, lid) end
end
if fields > 0 then redis.call('HINCRBY', META, 'N', -fields) end
local more
if ARGV[1] ~= '' then more = redis.call('EXISTS', BASE .. 'rc:' .. ARGV[1]) else more = redis.call('SCARD', DEAD) end
return {deleted, more}
"""


class _Script:
    __slots__ = ("name", "source", "sha")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


LOOKUP, HOLDERS, WRITE, REFRESH, RETIRE, PURGE = (
    _Script(n, s)
    for n, s in [
        ("lookup", _LOOKUP), ("holders", _HOLDERS), ("write", _WRITE),
        ("refresh", _REFRESH), ("retire", _RETIRE), ("purge", _PURGE),
    ]
)


def _chain(keys: list[bytes]) -> list[bytes]:
    """Keys as the scripts read them: key lengths (one, when all keys have it), then each key with
    its CRC-32 (the field it is stored under); two arguments, not one per key."""
    crc32 = zlib.crc32
    fields = b"".join([k + crc32(k).to_bytes(4, "little") for k in keys])
    if min(map(len, keys)) == max(map(len, keys)):
        return [len(keys[0]).to_bytes(2, "little"), fields]
    lengths = array("H", map(len, keys))
    if sys.byteorder == "big":
        lengths.byteswap()
    return [lengths.tobytes(), fields]
