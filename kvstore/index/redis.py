"""The prefix index in Redis (one server, or a Redis Cluster).

URLs: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix:///path``) for
one server; ``redis+cluster://host:port`` (or ``cluster=True``) for a Cluster,
the address being any one of its masters. A user and password in the URL
authenticate (``AUTH``); TLS files are query parameters of a ``rediss://`` URL
(:mod:`kvstore.index.redis_url`). Messages and reprs show the URL with its
password replaced by ``***``.

Key layout
----------
A namespace's keys share the hash tag ``{<prefix>:<namespace>}`` so that one
Lua script sees them all in one Cluster slot; node membership lives under
``{<prefix>}``::

    {p:ns}:meta        hash   M, S (linear-hashing level and split pointer),
                              N (blocks), seq (last holder id)
    {p:ns}:b:<n>       hash   bucket n (five letters): block key + its CRC-32 -> 4 bytes a holder
    {p:ns}:m           hash   node id -> "<holder id> <incarnation>" ("0 <inc>": inc ended)
    {p:ns}:i           hash   holder id -> "<epoch> <incarnation> <deadline ms> <node id>"
    {p:ns}:dead        set    holder ids whose rows wait for the sweep
    {p:ns}:r:<h>:<c>   hash   holder h's reverse index: bucket (c*128 + field) -> its rows there
    {p:ns}:rc:<h>      set    chunks c of holder h's reverse index
    {p}:nodes          hash   node id -> "<epoch> <incarnation> <deadline ms>"
    {p}:addr           hash   node id -> what it advertised at its latest join (JSON: address, transports)
    {p}:served         hash   node id -> its peer listeners' served bytes at its latest heartbeat
                              (JSON: scheme -> bytes; gone with a new incarnation or a leave)
    {p}:dl             zset   node id by deadline (finds expired nodes without a scan)
    {p}:seq            string last incarnation
    {p}:gone           hash   incarnation -> node id, ended but not yet retired everywhere
    {p}:nns:<inc>      set    namespaces incarnation <inc> wrote to (heartbeats refresh these)
    {p}:ns             set    every namespace (the sweep visits them)

Why this shape. A Redis key costs ~80 bytes before its value, so one key
per block cannot meet ~100 bytes per (block, holder). Blocks are therefore
fields of bucket hashes small enough to stay listpack-encoded (a packed
array, no per-field pointers), and a holder is a 4-byte record
(``holder id << 3 | tier``) in the field's value, the records sorted by holder
id. Buckets split one at a time by linear hashing on the key's CRC-32, keeping
~``LOAD`` blocks a bucket at any size without a rehash pause. Clients compute
the CRCs (C code, sent with the keys) and the field keeps them after the key,
so no script hashes in Lua (~10 us a key there). The reverse index does not
repeat block keys: it counts a holder's rows per bucket, so clearing a holder
visits only the buckets it has rows in: O(its blocks), the constant being one
bucket scan. Measured with 32-byte keys: ~52 bytes per block with one holder,
~4 more per extra holder (``tests/test_index_contract.py::test_bytes_per_entry``).

Lookups are one EVALSHA (EVAL again after NOSCRIPT); a chain travels as two
arguments (key lengths, then the fields end to end), not one per key. What a
lookup costs, and why it is shaped so:

- one HGET a block until the first miss (~2-3 us a block inside Lua, most of
  a lookup's server time; nothing cheaper reads a field of a compact bucket);
- sorted records make a block's value a canonical encoding of its holders
  and their tiers, so along a prefix that 25 nodes share the walk compares
  each value with the previous one (one string comparison: Lua strings are
  interned) and decodes only where holders or tiers change: O(nodes) per
  change instead of O(holders x blocks);
- the first block's holders are checked for liveness in one HMGET;
- bucket names are letters, not decimal (Lua's number formatting is
  sprintf), and the read scripts go through a small lane of connections
  that skips redis-py's per-command machinery (:class:`_ReadLane`).

A *holder id* names one node incarnation in one namespace. Answers count a
record only if its holder id is listed in ``{p:ns}:i`` with a deadline in the
future, so ``leave``, ``clear``, a restart (greater epoch) or an expiry drops
a node at once by deleting one field; the rows follow in the sweep.

Membership across slots. The lookup script can only read its own slot, so
each namespace keeps a mirror of the liveness of the nodes that wrote to it
(``{p:ns}:i``): a heartbeat updates ``{p}:nodes`` and then, in parallel, the
mirror of every namespace the node wrote to (``{p}:nns:<inc>``). Lookups
stay one round trip; a heartbeat costs one more per namespace of the node, a
node's first write to a namespace two more. Each server computes deadlines
from its own ``TIME`` plus the TTL, so client clocks never matter and server
clocks need not agree. ``{p}:nodes`` decides death: a namespace deletes rows
only of holder ids retired by ``leave``, ``clear``, a newer incarnation, or an
expiry ``{p}:nodes`` saw; a mirror that lapses a moment early (its refresh
still in flight) costs a brief false miss, never a deleted row.

Limits: fields and values over ``hash-max-listpack-value`` (64 bytes by
default: keys longer than 60 bytes, or blocks with more than 16 holders) turn
their bucket into a plain hash table, correct but several times larger; a
namespace lives on one Cluster shard; holder ids are 29 bits per namespace
(one per node incarnation or clear); the ``m`` tombstone of a node that left
stays (a few dozen bytes) so that a late write of it is refused; buckets
never merge when a namespace shrinks (an emptied bucket costs nothing); a
namespace stops splitting at ``MAX_BUCKETS`` buckets (~475M blocks).

This layout replaced one whose values began with the CRC and whose records
were unsorted; an index written by that version is not readable by this one
(when upgrading, flush the index's keys or use a new ``prefix``, and restart
the daemons so that they publish what they hold again).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvstore.block import TierName, validate_namespace
from kvstore.errors import InvalidArgument, PrefixIndexError, StaleEpoch
from kvstore.index import redis_url
from kvstore.index.base import (
    Holder,
    IndexUnavailable,
    NodeInfo,
    NodeMatch,
    PrefixIndex,
    check_blocks,
    check_budget,
    check_candidates,
    check_contact,
    check_keys,
    check_node,
    check_node_id,
    check_served,
    check_ttl,
)

log = logging.getLogger(__name__)

LOAD = 40  # blocks per bucket on average; buckets stay under listpack's 128 entries
LANE_CONNECTIONS = 4  # read-lane connections a single-server index keeps; more concurrent reads use the pool
LANE_TIMEOUT_S = 5.0  # a lane call's deadline when the client sets no socket timeout
MAX_BUCKETS = 26**5  # bucket names have five letters; past ~475M blocks a namespace's buckets grow instead
PURGE_BATCH = 4096  # rows one script deletes for leave/clear (each call is short; Redis stays responsive)
REAP_BATCH = 64  # ended incarnations retired per sweep call
_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")

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

_GLOBAL = _COMMON + r"""
local NODES = KEYS[1]
local GB = string.sub(NODES, 1, -6)
local DL, GONE, ALLNS, ADDR, SERVED = GB .. 'dl', GB .. 'gone', GB .. 'ns', GB .. 'addr', GB .. 'served'
local function record(node)
  local r = redis.call('HGET', NODES, node)
  if not r then return nil end
  local e, g, d = string.match(r, '^(%d+) (%d+) (%d+)$')
  return e, tonumber(g), tonumber(d)
end
local function nslist(g) return redis.call('SMEMBERS', GB .. 'nns:' .. g) end
local function put(node, e, g, d)
  redis.call('HSET', NODES, node, e .. ' ' .. g .. ' ' .. d)
  redis.call('ZADD', DL, d, node)
end
-- the node's live incarnation at this epoch, or a refusal
local function current(node, epoch, now)
  local e, g, d = record(node)
  if not e then return nil, {'NOJOIN'} end
  local c = ecmp(epoch, e)
  if c < 0 then return nil, {'STALE', e} end
  if c > 0 then return nil, {'NEWER', e} end
  if d <= now then return nil, {'EXPIRED'} end
  return g, d
end
"""

# ARGV: node, epoch, ttl ms, what it advertises ('' for nothing)
_JOIN = _GLOBAL + r"""
local now = now_ms()
local node, epoch, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local e, g, d = record(node)
local function advertise()
  if ARGV[4] == '' then redis.call('HDEL', ADDR, node) else redis.call('HSET', ADDR, node, ARGV[4]) end
end
if e then
  local c = ecmp(epoch, e)
  if c < 0 then return {'STALE', e} end
  if c == 0 and d > now then
    put(node, e, g, now + ttl)
    advertise()
    return {'SAME', g, nslist(g)}
  end
  redis.call('HSET', GONE, g, node)
end
local ng = redis.call('INCR', GB .. 'seq')
put(node, epoch, ng, now + ttl)
advertise()
redis.call('HDEL', SERVED, node)  -- a new incarnation has served nothing yet
if e then return {'NEW', ng, g, nslist(g)} end
return {'NEW', ng}
"""

# ARGV: node, epoch, ttl ms, served-bytes counters ('' leaves them)
_BEAT = _GLOBAL + r"""
local now = now_ms()
local node, epoch = ARGV[1], ARGV[2]
local g, d = current(node, epoch, now)
if not g then return d end
local e = record(node)
put(node, e, g, now + tonumber(ARGV[3]))
if ARGV[4] ~= '' then redis.call('HSET', SERVED, node, ARGV[4]) end
return {'OK', g, nslist(g)}
"""

# ARGV: node, epoch, namespace. Records that the incarnation writes to the namespace.
_ATTACH = _GLOBAL + r"""
local now = now_ms()
local g, d = current(ARGV[1], ARGV[2], now)
if not g then return d end
redis.call('SADD', GB .. 'nns:' .. g, ARGV[3])
redis.call('SADD', ALLNS, ARGV[3])
return {'OK', g, d - now}
"""

# ARGV: node
_LEAVE = _GLOBAL + r"""
local node = ARGV[1]
local e, g = record(node)
if not e then return {} end
redis.call('HDEL', NODES, node)
redis.call('HDEL', ADDR, node)
redis.call('HDEL', SERVED, node)
redis.call('ZREM', DL, node)
redis.call('HSET', GONE, g, node)
return {g, nslist(g)}
"""

# ARGV: node. The namespaces of its current incarnation.
_SPREAD = _GLOBAL + r"""
local e, g = record(ARGV[1])
if not e then return {} end
return nslist(g)
"""

# ARGV: limit. Ended incarnations (left, replaced, expired) still to retire: {node, inc, namespaces}.
_REAP = _GLOBAL + r"""
local now = now_ms()
local lim = tonumber(ARGV[1])
local out = {}
local gone = redis.call('HGETALL', GONE)
for j = 1, #gone, 2 do
  if #out >= lim then break end
  out[#out + 1] = {gone[j + 1], gone[j], nslist(gone[j])}
end
if #out < lim then
  for _, node in ipairs(redis.call('ZRANGEBYSCORE', DL, '-inf', now, 'LIMIT', 0, lim - #out)) do
    local e, g, d = record(node)
    if e and d <= now then out[#out + 1] = {node, tostring(g), nslist(g)} end
  end
end
return out
"""

# ARGV: node, inc, node, inc, ... retired everywhere.
_FINISH = _GLOBAL + r"""
for j = 1, #ARGV, 2 do
  local node, g = ARGV[j], ARGV[j + 1]
  redis.call('DEL', GB .. 'nns:' .. g)
  redis.call('HDEL', GONE, g)
  local e, cg = record(node)
  if e and cg == tonumber(g) then redis.call('ZREM', DL, node) end
end
return 1
"""

_NODES = _GLOBAL + r"""
local now = now_ms()
local out = {}
local all = redis.call('HGETALL', NODES)
for j = 1, #all, 2 do
  local e, g, d = string.match(all[j + 1], '^(%d+) (%d+) (%d+)$')
  out[#out + 1] = {all[j], e, tonumber(d) > now and 1 or 0, redis.call('HGET', ADDR, all[j]) or '',
                   redis.call('HGET', SERVED, all[j]) or ''}
end
return out
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
JOIN, BEAT, ATTACH, LEAVE, SPREAD, REAP, FINISH, NODES = (
    _Script(n, s)
    for n, s in [
        ("join", _JOIN), ("heartbeat", _BEAT), ("attach", _ATTACH), ("leave", _LEAVE),
        ("spread", _SPREAD), ("reap", _REAP), ("finish", _FINISH), ("nodes", _NODES),
    ]
)

_UNAVAILABLE = (
    rexc.ConnectionError,  # includes BusyLoadingError, AuthenticationError
    rexc.TimeoutError,
    rexc.ClusterError,  # ClusterDownError, MasterDownError
    rexc.TryAgainError,
    rexc.ReadOnlyError,
    rexc.OutOfMemoryError,
    rexc.RedisClusterException,  # no reachable startup node, slot not covered
)
_BUSY = ("BUSY", "LOADING", "MASTERDOWN")  # replies of a server that is there but cannot serve yet
# How a refused AUTH reads once a Cluster client has wrapped it in RedisClusterException (as text).
_AUTH_REFUSED = ("WRONGPASS", "NOAUTH", "invalid username-password pair", "Authentication required",
                 "HELLO must be called with the client already authenticated", "invalid password")
_TIERS = {int(t): t for t in TierName}


def _auth_failure(err: BaseException) -> bool:
    """Whether Redis refused the credentials (or wanted some), however redis-py wrapped it."""
    seen: BaseException | None = err
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            break
        if isinstance(seen, rexc.AuthenticationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(marker in str(err) for marker in _AUTH_REFUSED)


class _Detour(Exception):
    """The read lane cannot take this call; the ordinary path must."""


class _ReadLane:
    """A few connections kept out of redis-py's pool for the read scripts (lookup, holders) of
    a single server.

    Why: redis-py's per-command path (a pool checkout and return, a retry wrapper, an
    asyncio Task per send to apply the socket timeout, a timer per read) costs ~60 us here,
    a sixth of a 64-block lookup. A lane connection sends the packed command and reads the
    reply itself under one deadline for the whole call. What the lane does not handle (all
    its connections busy, NOSCRIPT, a broken connection) goes the ordinary way, with its
    retries and reconnects; a Cluster client has no lane (it routes by slot).
    """

    def __init__(self, pool: Any, timeout_s: float, size: int) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._size = size
        self._idle: list[Any] = []
        self._busy = 0

    async def call(self, command: tuple) -> Any:
        if self._idle:
            conn = self._idle.pop()
        elif self._busy < self._size:
            # the pool's own settings (address, TLS, credentials, db), minus the socket timeout
            # whose per-send Task is what the lane avoids: the call's deadline replaces it
            conn = self._pool.connection_class(**{**self._pool.connection_kwargs, "socket_timeout": None})
        else:
            raise _Detour
        self._busy += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                await conn.send_packed_command(conn.pack_command(*command), check_health=False)
                reply = await conn.read_response()
        except rexc.ResponseError:  # the reply was read whole: the connection is fine
            self._busy -= 1
            self._idle.append(conn)
            raise
        except BaseException:  # broken, timed out or cancelled part-way: never reuse
            self._busy -= 1
            await conn.disconnect(nowait=True)
            raise
        self._busy -= 1
        self._idle.append(conn)
        return reply

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect()


class RedisIndex(PrefixIndex):
    """Use :meth:`from_url`; the constructor takes a ready ``redis.asyncio`` client."""

    def __init__(
        self, client: Redis | RedisCluster, *, where: str = "redis", prefix: str = "strata", tls: bool = False
    ) -> None:
        if not prefix or not set(prefix) <= _PREFIX_CHARS:
            raise InvalidArgument(f"key prefix {prefix!r} must be non-empty and use only [A-Za-z0-9._-]")
        self._redis = client
        self._where = redis_url.redact(where)
        self._tls = tls
        self._prefix = prefix
        self._nodes_key = "{%s}:nodes" % prefix
        self._sweep_turn = 0
        self._lane: _ReadLane | None = None
        if not isinstance(client, RedisCluster):
            pool = client.connection_pool
            timeout_s = pool.connection_kwargs.get("socket_timeout") or LANE_TIMEOUT_S
            self._lane = _ReadLane(pool, timeout_s, LANE_CONNECTIONS)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool | None = None,
        prefix: str = "strata",
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retries: int = 2,
    ) -> RedisIndex:
        """``redis://[USER:PASSWORD@]host:port/db``, ``rediss://…[?tls_ca_file=…]``, ``unix:///path``,
        or ``redis+cluster://host:port`` (:mod:`kvstore.index.redis_url` has the syntax).

        ``cluster=True`` treats a plain ``redis://`` URL as a Cluster's entry point. Every
        command has ``timeout_s``; a failed connection is retried ``retries`` times, briefly.
        """
        parsed = redis_url.parse(url)
        cluster = cluster or parsed.cluster
        options: dict[str, Any] = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            **parsed.options,
        )
        try:
            if cluster:
                client: Redis | RedisCluster = RedisCluster.from_url(parsed.client_url, **options)
            else:
                client = Redis.from_url(parsed.client_url, **options)
        except (ValueError, TypeError, rexc.RedisError, rexc.RedisClusterException) as err:
            raise InvalidArgument(f"index URL {parsed.where}: {err}") from None
        return cls(client, where=parsed.where, prefix=prefix, tls=parsed.tls)

    def __repr__(self) -> str:
        return f"<RedisIndex {self._where} prefix={self._prefix}>"

    async def close(self) -> None:
        if self._lane is not None:
            await self._lane.close()
        await self._redis.aclose()

    # ---- membership ------------------------------------------------------------

    async def join(
        self, node_id: str, epoch: int, ttl_s: float, *, address: str = "", transports: Sequence[str] = ()
    ) -> None:
        check_node(node_id, epoch)
        check_ttl(ttl_s)
        address, transports = check_contact(address, transports)
        contact = json.dumps({"address": address, "transports": list(transports)}) if address or transports else ""
        r = await self._global(JOIN, node_id, str(epoch), _ms(ttl_s), contact)
        if r[0] == b"STALE":
            raise StaleEpoch(_older(node_id, epoch, r[1]))
        if r[0] == b"SAME":
            await self._refresh(node_id, r[1], r[2], ttl_s)
        elif len(r) > 2:  # a new incarnation replaced a previous one: it stops counting now
            await self._end(node_id, r[2], r[3], purge=False)

    async def heartbeat(self, node_id: str, epoch: int, ttl_s: float, *, served: Mapping[str, int] | None = None) -> None:
        check_node(node_id, epoch)
        check_ttl(ttl_s)
        counters = check_served(served)
        r = await self._global(BEAT, node_id, str(epoch), _ms(ttl_s), "" if counters is None else json.dumps(dict(counters)))
        self._raise_refusal(node_id, epoch, r)
        await self._refresh(node_id, r[1], r[2], ttl_s)

    async def leave(self, node_id: str) -> None:
        check_node_id(node_id)
        r = await self._global(LEAVE, node_id)
        if r:
            await self._end(node_id, r[0], r[1], purge=True)

    async def nodes(self) -> list[NodeInfo]:
        rows = await self._global(NODES)
        return sorted((_node_info(*row) for row in rows), key=lambda i: i.node_id)

    # ---- writes ----------------------------------------------------------------

    async def add(self, namespace: str, node_id: str, epoch: int, blocks: Sequence[tuple[bytes, TierName]]) -> None:
        validate_namespace(namespace)
        check_node(node_id, epoch)
        checked = check_blocks(blocks)
        if checked:
            keys = [key for key, _ in checked]
            await self._write(namespace, "add", node_id, epoch, [*_chain(keys), bytes(int(t) for _, t in checked)])

    async def remove(self, namespace: str, node_id: str, epoch: int, keys: Sequence[bytes]) -> None:
        validate_namespace(namespace)
        check_node(node_id, epoch)
        checked = check_keys(keys, allow_empty=True)
        if checked:
            await self._write(namespace, "del", node_id, epoch, _chain(checked))

    async def clear(self, node_id: str, namespace: str | None = None) -> None:
        check_node_id(node_id)
        if namespace is not None:
            namespaces = [validate_namespace(namespace)]
        else:
            namespaces = [n.decode() for n in await self._global(SPREAD, node_id)]
        lids = await asyncio.gather(*(self._ns(RETIRE, ns, node_id, "") for ns in namespaces))
        await asyncio.gather(*(self._purge(ns, lid) for ns, lid in zip(namespaces, lids) if lid))

    # ---- reads -----------------------------------------------------------------

    async def lookup(
        self, namespace: str, keys: Sequence[bytes], candidates: Sequence[str] | None = None
    ) -> list[NodeMatch]:
        validate_namespace(namespace)
        chain = check_keys(keys)
        wanted = check_candidates(candidates)
        if wanted is not None and not wanted:
            return []
        head = [-1] if wanted is None else [len(wanted), *sorted(wanted)]
        flat = await self._read(LOOKUP, namespace, *head, *_chain(chain))
        # sort_matches' order, on (-blocks, node id as UTF-8): bytes of UTF-8 sort as its code points do
        rows = sorted(zip([-n for n in flat[1::3]], flat[0::3], flat[2::3]))
        return [NodeMatch(node.decode(), -n, _TIERS[t]) for n, node, t in rows]

    async def holders(self, namespace: str, keys: Sequence[bytes]) -> list[list[Holder]]:
        validate_namespace(namespace)
        checked = check_keys(keys, allow_empty=True)
        if not checked:
            return []
        per_key = await self._read(HOLDERS, namespace, *_chain(checked))
        return [
            sorted(
                (Holder(f[i].decode(), TierName(int(f[i + 1])), int(f[i + 2])) for i in range(0, len(f), 3)),
                key=lambda h: h.node_id,
            )
            for f in per_key
        ]

    # ---- maintenance -----------------------------------------------------------

    async def sweep(self, max_entries: int = 1000) -> int:
        check_budget(max_entries)
        await self._reap()
        namespaces = sorted(n.decode() for n in await self._call("SMEMBERS", "{%s}:ns" % self._prefix))
        pending = await asyncio.gather(*(self._call("SCARD", self._ns_key(ns, "dead")) for ns in namespaces))
        dirty = [ns for ns, n in zip(namespaces, pending) if n]
        if not dirty:
            return 0
        self._sweep_turn = (self._sweep_turn + 1) % len(dirty)  # no namespace starves the others
        deleted = 0
        for ns in dirty[self._sweep_turn :] + dirty[: self._sweep_turn]:
            if deleted >= max_entries:
                break
            n, _ = await self._ns(PURGE, ns, "", max_entries - deleted)
            deleted += n
        return deleted

    # ---- internals -------------------------------------------------------------

    async def _write(self, namespace: str, op: str, node_id: str, epoch: int, data: list) -> None:
        args = [op, node_id, str(epoch), "", 0, *data]
        r = await self._ns(WRITE, namespace, *args)
        if r[0] == b"NOJOIN":  # the namespace's mirror does not know this incarnation yet (or lapsed)
            a = await self._global(ATTACH, node_id, str(epoch), namespace)
            self._raise_refusal(node_id, epoch, a)
            args[3], args[4] = a[1], a[2]
            r = await self._ns(WRITE, namespace, *args)
        if r[0] == b"STALE":
            raise StaleEpoch(_older(node_id, epoch, r[1]))
        if r[0] in (b"NEWER", b"GONE"):
            raise StaleEpoch(f"node {node_id!r} at epoch {epoch} ended while writing: join again and re-add its blocks")
        if r[0] != b"OK":
            raise PrefixIndexError(f"unexpected answer from the index script: {r!r}")

    def _raise_refusal(self, node_id: str, epoch: int, r: list) -> None:
        status = r[0] if r else b"NOJOIN"
        if status == b"OK":
            return
        if status == b"STALE":
            raise StaleEpoch(_older(node_id, epoch, r[1]))
        if status == b"NEWER":
            raise StaleEpoch(
                f"node {node_id!r} joined at epoch {int(r[1])}, not {epoch}: join at epoch {epoch} first"
            )
        if status == b"EXPIRED":
            raise StaleEpoch(f"node {node_id!r} missed its heartbeats and expired: join again and re-add its blocks")
        raise StaleEpoch(f"node {node_id!r} is not a member of the prefix index: join it first")

    async def _refresh(self, node_id: str, inc: int, namespaces: list[bytes], ttl_s: float) -> None:
        ms = _ms(ttl_s)
        await asyncio.gather(*(self._ns(REFRESH, ns.decode(), node_id, inc, ms) for ns in namespaces))

    async def _end(self, node_id: str, inc: int | bytes, namespaces: list[bytes], *, purge: bool) -> None:
        """Retire an ended incarnation in every namespace it wrote to, then tell the membership."""
        names = [ns.decode() for ns in namespaces]
        lids = await asyncio.gather(*(self._ns(RETIRE, ns, node_id, inc) for ns in names))
        if purge:
            await asyncio.gather(*(self._purge(ns, lid) for ns, lid in zip(names, lids) if lid))
        await self._global(FINISH, node_id, inc)

    async def _purge(self, namespace: str, lid: int) -> None:
        while True:
            _, more = await self._ns(PURGE, namespace, lid, PURGE_BATCH)
            if not more:
                return

    async def _reap(self) -> None:
        ended = await self._global(REAP, REAP_BATCH)
        for node, inc, namespaces in ended:
            await self._end(node.decode(), inc, namespaces, purge=False)

    def _ns_key(self, namespace: str, suffix: str) -> str:
        return "{%s:%s}:%s" % (self._prefix, namespace, suffix)

    async def _ns(self, script: _Script, namespace: str, *args: Any) -> Any:
        return await self._eval(script, self._ns_key(namespace, "meta"), args)

    async def _global(self, script: _Script, *args: Any) -> Any:
        return await self._eval(script, self._nodes_key, args)

    async def _read(self, script: _Script, namespace: str, *args: Any) -> Any:
        """A read script through the lane when there is one; anything it cannot finish goes the
        ordinary way (NOSCRIPT: EVAL sends the script; a broken connection: reconnect, retry)."""
        key = self._ns_key(namespace, "meta")
        if self._lane is not None:
            try:
                return await self._lane.call(("EVALSHA", script.sha, 1, key, *args))
            except (_Detour, rexc.NoScriptError, rexc.ConnectionError, rexc.TimeoutError, OSError):
                pass  # rexc.TimeoutError here is a connect timeout: the ordinary path retries or reports it
            except TimeoutError as err:  # the call's deadline
                raise self._unavailable(err) from err
            except rexc.RedisError as err:
                raise self._refused(script, err) from err
        return await self._eval(script, key, args)

    async def _eval(self, script: _Script, key: str, args: Sequence[Any]) -> Any:
        """EVALSHA; on NOSCRIPT (a restarted or flushed server) EVAL, which caches the script again."""
        try:
            try:
                return await self._redis.evalsha(script.sha, 1, key, *args)
            except rexc.NoScriptError:
                log.debug("Redis at %s lacks the %s script; sending it", self._where, script.name)
                return await self._redis.eval(script.source, 1, key, *args)
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err
        except rexc.RedisError as err:
            raise self._refused(script, err) from err

    def _refused(self, script: _Script, err: rexc.RedisError) -> PrefixIndexError:
        if str(err).startswith(_BUSY):
            return self._unavailable(err)
        if isinstance(err, rexc.NoPermissionError):
            return PrefixIndexError(
                f"Redis at {self._where} refused the {script.name} script: {err}: grant the index's user scripts "
                f"and reads and writes of its keys, e.g. ACL SETUSER USER +@scripting +@read +@write +@fast "
                f"~{{{self._prefix}}}* ~{{{self._prefix}:*"
            )
        return PrefixIndexError(f"Redis at {self._where} refused the {script.name} script: {err}")

    async def _call(self, *command: Any) -> Any:
        try:
            return await self._redis.execute_command(*command)
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err
        except rexc.RedisError as err:
            if str(err).startswith(_BUSY):
                raise self._unavailable(err) from err
            raise PrefixIndexError(f"Redis at {self._where} refused {command[0]}: {err}") from err

    def _unavailable(self, err: BaseException) -> IndexUnavailable:
        """Unreachable, refused credentials or a failed TLS handshake: all are the index being
        unavailable to this node (the daemon serves local hits and retries), each with its fix."""
        what = f"{type(err).__name__}: {err}"
        if _auth_failure(err):
            return IndexUnavailable(
                f"Redis at {self._where} refused the index's credentials ({what}): put the right user and "
                "password in index_url (STRATA_INDEX_URL), redis://USER:PASSWORD@HOST:PORT/DB, or "
                "redis://:PASSWORD@HOST:PORT/DB for a server with requirepass (percent-encode special characters)"
            )
        fix = "check that Redis runs there and that index_url (STRATA_INDEX_URL) points at it"
        if self._tls:
            fix += (
                "; for TLS, that tls_ca_file holds the CA that signed the server's certificate and the certificate "
                "names the URL's host, and that tls_cert_file and tls_key_file are given if the server requires "
                "client certificates"
            )
        elif "reset by peer" in str(err) or "closed by server" in str(err):
            fix += "; if the server speaks TLS, use rediss://"
        return IndexUnavailable(f"the prefix index at {self._where} cannot be reached ({what}): {fix}")


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


def _node_info(node: bytes, epoch: bytes, alive: int, contact: bytes, served: bytes = b"") -> NodeInfo:
    address, transports, counters = "", (), ()
    if contact:
        try:
            record = json.loads(contact)
            address, transports = check_contact(record.get("address", ""), record.get("transports", ()))
        except (ValueError, AttributeError, InvalidArgument):  # written by something else: reported as none
            log.warning("the prefix index holds an unreadable address record for node %r: ignored", node)
    if served:
        try:
            counters = check_served(json.loads(served)) or ()
        except (ValueError, InvalidArgument):
            log.warning("the prefix index holds unreadable served-bytes counters for node %r: ignored", node)
    return NodeInfo(node.decode(), int(epoch), bool(alive), address, transports, counters)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _older(node_id: str, epoch: int, current: bytes) -> str:
    return (
        f"node {node_id!r} is at epoch {int(current)}; epoch {epoch} is older: "
        "this process was replaced by a restarted one and must stop writing"
    )
